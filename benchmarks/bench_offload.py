"""ZeRO-3 CPU offload on one GPU: native (FSDP2's CPUOffloadPolicy) against DeepSpeed, on a model that
does not fit in bf16 mixed precision + AdamW without offload.

    python benchmarks/bench_offload.py --out DIR            # llama-8b shape cut to 20 layers (5.4B), one H100/H200
    python benchmarks/bench_offload.py --only check,native  # some legs
    python benchmarks/bench_offload.py --smoke              # tiny model on the CPU, every leg

The default model holds 5.4B parameters: fp32 weights, gradients and the two Adam moments need
16 bytes each, 87 GB, more than an 80 GB GPU (the ``no-offload`` leg records its out-of-memory
error) and less than a 128 GB host. Each leg is one ``Trainer.fit`` in a fresh child process
(``ZeroStrategy`` on one device, bf16-mixed, ``init="meta"``), so a leg that fails or runs out of
memory is recorded and the next starts clean:

- ``check``: a small model trained a few steps in fp32 with and without native offload in one
  process: losses and parameters side by side, and where the shards live (CPU, pinned);
- ``native``: ``ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, backend="native")``,
  AdamW as the GPT module picks it for CPU parameters (foreach);
- ``native-fused-adam``: the same with ``fused_adam=True`` (torch's fused AdamW, CPU kernel);
- ``deepspeed``: the same offload through DeepSpeed (if importable), torch's AdamW on its CPU state;
- ``no-offload``: ``zero3`` without offload.

Per leg: wall-clock tokens/s over the steps after ``--warmup`` (the mean step), median and p90
step, peak GPU memory allocated and reserved, peak host RSS. The JSON
(``bench_offload_<device>_<date>.json`` under ``--out``) is rewritten after every leg.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LEGS = ("check", "native", "native-fused-adam", "deepspeed", "no-offload")


def _strategy(name: str) -> Any:
    from lightning_perf.strategies import ZeroStrategy

    if name.startswith("native"):
        return ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, backend="native", init="meta")
    if name == "deepspeed":
        return ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, backend="deepspeed", init="meta")
    return ZeroStrategy(stage=3, init="meta")


def _fit(args: argparse.Namespace, strategy: Any, *, model: str, overrides: dict, precision: str, steps: int,
         fused_adam: Any, callbacks: list) -> Any:
    import lightning as L

    from lightning_perf.data import TokenDataModule
    from lightning_perf.models.gpt.module import GPTLightningModule

    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(model, config_overrides=overrides, fused_adam=fused_adam, warmup_steps=0,
                                learning_rate=1e-4, min_lr_ratio=1.0)
    data = TokenDataModule(source="synthetic", vocab_size=module.config.vocab_size, seq_len=args.seq_len,
                           batch_size=args.batch, num_workers=0)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, precision=precision,
                        max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(module, data)
    return trainer, module


def _check(args: argparse.Namespace) -> dict[str, Any]:
    """Native offload against no offload on one device, fp32, the same seed and data."""
    import lightning as L

    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict
    from lightning_perf.strategies import ZeroStrategy

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.where: dict[str, Any] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            shards = [p.to_local() for p in pl_module.parameters()]
            self.where = {"devices": sorted({s.device.type for s in shards}),
                          "pinned": sorted({s.is_pinned() for s in shards})}

    out: dict[str, Any] = {}
    for name, strategy in (("plain", ZeroStrategy(stage=3)),
                           ("offload", ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True,
                                                    backend="native"))):
        rec = Losses()
        args_small = argparse.Namespace(**{**vars(args), "seq_len": 128, "batch": 4})
        _, module = _fit(args_small, strategy, model="tiny-llama", overrides={}, precision="32-true", steps=4,
                         fused_adam=False, callbacks=[rec])
        out[name] = {"losses": rec.losses, "where": rec.where, "final": full_model_state_dict(module)}
    diffs = {k: (out["offload"]["final"][k] - v).abs().max().item() for k, v in out["plain"]["final"].items()}
    loss_diff = max(abs(a - b) for a, b in zip(out["plain"]["losses"], out["offload"]["losses"]))
    close = all(torch.allclose(out["offload"]["final"][k], v, rtol=1e-4, atol=1e-5)
                for k, v in out["plain"]["final"].items())
    return {"losses": {k: out[k]["losses"] for k in ("plain", "offload")}, "max_loss_diff": loss_diff,
            "max_param_diff": max(diffs.values()), "params_close_rtol_1e-4": close,
            "offload_shards": out["offload"]["where"], "plain_shards": out["plain"]["where"]}


def run_leg(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from _timing import WallClockWindow

    if name == "check":
        return _check(args)
    if name == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return {"skipped": "deepspeed is not installed"}
    os.environ["BENCH_WINDOW_CHECKPOINT"] = "0"  # a checkpoint of the whole state is not what is measured
    window = WallClockWindow(warmup=args.warmup)
    overrides = {"n_layer": args.layers} if args.layers else {}
    trainer, module = _fit(args, _strategy(name), model=args.model, overrides=overrides, precision=args.precision,
                           steps=args.warmup + args.steps, fused_adam=True if name == "native-fused-adam" else None,
                           callbacks=[window])
    res = dict(window.result)
    res["params"] = module.config.num_params()
    res["tokens_per_step"] = args.batch * args.seq_len
    if torch.cuda.is_available():
        res["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    opt = trainer.optimizers[0]
    inner = getattr(opt, "optimizer", opt)  # DeepSpeed's wraps the module's AdamW
    res["optimizer"] = {"class": type(opt).__name__, "inner": type(inner).__name__,
                        **{k: getattr(inner, "defaults", {}).get(k) for k in ("fused", "foreach")}}
    return res


def _host_peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _child(args: argparse.Namespace) -> None:
    t = time.perf_counter()
    try:
        res = run_leg(args, args.leg)
    except BaseException as e:  # recorded: an out-of-memory error is a result here
        res = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    res["leg_s"] = time.perf_counter() - t
    res["host_peak_rss_gb"] = _host_peak_gb()
    Path(args.leg_out).write_text(json.dumps(res, indent=2, default=str))


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--layers", type=int, default=20, help="override n_layer (0: the preset's)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps after the warm-up")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--only", default=",".join(LEGS))
    p.add_argument("--leg-timeout", type=float, default=900.0)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--tag", default="")
    p.add_argument("--leg", help=argparse.SUPPRESS)
    p.add_argument("--leg-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.layers, args.seq_len, args.batch, args.warmup, args.steps = "tiny-llama", 0, 64, 2, 1, 2
        args.precision = "32-true"  # bf16 matmuls are slow on a CPU
    args.accelerator = "gpu" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.leg:
        return _child(args)

    legs = [leg for leg in args.only.split(",") if leg]
    unknown = sorted(set(legs) - set(LEGS))
    if unknown:
        raise SystemExit(f"unknown legs {unknown}; known: {LEGS}")
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"
    short = "cpu" if args.accelerator == "cpu" else ("h200" if "H200" in device else "h100" if "H100" in device
                                                    else device.replace(" ", "_").lower())
    out = Path(args.out) / f"bench_offload_{short}_{datetime.date.today():%Y%m%d}{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import lightning as L

    result: dict[str, Any] = {
        "device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "lightning": L.__version__},
        "config": {k: v for k, v in vars(args).items() if k not in ("leg", "leg_out")}, "legs": {},
    }
    try:
        import deepspeed

        result["versions"]["deepspeed"] = deepspeed.__version__
    except ImportError:  # its leg then records the missing package
        result["versions"]["deepspeed"] = None
    passthrough = list(argv if argv is not None else sys.argv[1:])  # a child runs its --leg only
    for leg in legs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            leg_out = f.name
        cmd = [sys.executable, __file__, *passthrough, "--leg", leg, "--leg-out", leg_out]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.leg_timeout)
            text = Path(leg_out).read_text() if Path(leg_out).stat().st_size else ""
            res = json.loads(text) if text else {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {args.leg_timeout:.0f}s"}
        finally:
            os.unlink(leg_out)
        res.setdefault("leg_s", time.perf_counter() - t)
        result["legs"][leg] = res
        out.write_text(json.dumps(result, indent=2, default=str))
        summary = {k: res.get(k) for k in ("tokens_per_s", "peak_mem_gb", "host_peak_rss_gb", "error",
                                          "max_param_diff", "skipped") if res.get(k) is not None}
        print(f"{leg}: {summary}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
