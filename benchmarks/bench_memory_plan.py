"""The memory planner against the GPU: measured allocated memory of training steps beside
``lightning_perf.estimate_memory``'s prediction for the same run.

``--part layers`` (one GPU): each variant trains a few steps through ``Trainer.fit`` with the pack's module
and strategy on synthetic tokens, twice, with ``--layers`` blocks (default 2 and 4; presets keep their
widths), so the difference between the two gives one block's saved activations per token with nothing else
in it. Per run it records the allocated bytes at the batch start, before the backward (after the forward,
so the difference is what the forward keeps for the backward) and the step's peak, beside the planner's
parts and peak. The JSON's ``per_block_activation_bytes_per_token`` per variant is what the planner's
calibration table takes (``lightning_perf/perf/memory_plan.py``).

``--part fit`` (one GPU): whole models at their own depth (the single-GPU recipes' models), measured peak
against predicted peak.

    python benchmarks/bench_memory_plan.py --part layers --out $OUT                    # every variant, one GPU
    python benchmarks/bench_memory_plan.py --part layers --only llama8b_fp8_none,llama8b_fp8_selective
    python benchmarks/bench_memory_plan.py --part fit --only gpt13b_plain
    python benchmarks/bench_memory_plan.py --smoke                                     # CPU: the code paths only

Each run is its own process (a fresh allocator and compile cache per variant); ``--timeout`` bounds it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any, Optional

_LLAMA_FP8 = {"kernels": "triton", "attention": "auto", "fp8": "tensorwise", "fused_qkv": True}
_GPT_FP8 = {"kernels": "triton", "attention": "auto", "fp8": "tensorwise", "fused_qkv": True}

#: name -> (preset, config overrides, module kwargs, strategy ("zero3", "zero3_fp8gather", "single"), seq_len, batch)
VARIANTS: dict[str, dict[str, Any]] = {
    # the llama-8b-zero3 recipe's block (FSDP2, bf16 weights, FP8 gathered), per checkpointing mode
    "llama8b_fp8_none": dict(preset="llama-8b", overrides=_LLAMA_FP8, ac="none", compile="default",
                             strategy="zero3_fp8gather", seq_len=8192, batch=1),
    "llama8b_fp8_selective": dict(preset="llama-8b", overrides=_LLAMA_FP8, ac="selective", compile="default",
                                  strategy="zero3_fp8gather", seq_len=8192, batch=1),
    "llama8b_fp8_full": dict(preset="llama-8b", overrides=_LLAMA_FP8, ac="full", compile="default",
                             strategy="zero3_fp8gather", seq_len=8192, batch=1),
    "llama8b_fp8_none_eager": dict(preset="llama-8b", overrides=_LLAMA_FP8, ac="none", compile=None,
                                   strategy="zero3_fp8gather", seq_len=8192, batch=1),
    "llama8b_bf16_none": dict(preset="llama-8b", overrides={"kernels": "triton", "attention": "auto"}, ac="none",
                              compile="default", strategy="zero3", seq_len=8192, batch=1),
    "llama8b_bf16_selective": dict(preset="llama-8b", overrides={"kernels": "triton", "attention": "auto"},
                                   ac="selective", compile="default", strategy="zero3", seq_len=8192, batch=1),
    "llama8b_bf16_none_eager": dict(preset="llama-8b", overrides={"kernels": "torch", "attention": "sdpa"},
                                    ac="none", compile=None, strategy="zero3", seq_len=8192, batch=1),
    # gpt-1.3b blocks: one device (fp32 weights under autocast) and under FSDP2
    "gpt13b_plain_block": dict(preset="gpt-1.3b", overrides={}, ac="none", compile="default", compile_scope="model",
                               strategy="single", seq_len=2048, batch=8),
    "gpt13b_plain_block_eager": dict(preset="gpt-1.3b", overrides={}, ac="none", compile=None, strategy="single",
                                     seq_len=2048, batch=8),
    "gpt13b_fp8_delayed_block": dict(preset="gpt-1.3b", overrides={"kernels": "triton", "attention": "auto",
                                                                   "fp8": "delayed", "fused_qkv": True},
                                     ac="none", compile="default", compile_scope="model", strategy="single",
                                     seq_len=2048, batch=8),
    "gpt13b_zero3_fp8_block": dict(preset="gpt-1.3b", overrides=_GPT_FP8, ac="none", compile="default",
                                   strategy="zero3", seq_len=2048, batch=8),
}

#: whole models on one GPU (``--part fit``)
FITS: dict[str, dict[str, Any]] = {
    "gpt13b_plain": dict(VARIANTS["gpt13b_plain_block"], layers=None),
    "gpt13b_fp8_delayed": dict(preset="gpt-1.3b", overrides={"kernels": "triton", "attention": "auto",
                                                             "fp8": "delayed", "fused_qkv": True},
                               ac="none", compile="default", compile_scope="model", strategy="single",
                               seq_len=2048, batch=8, layers=None),
    "gpt2_124m_model": dict(preset="gpt2-124m", overrides={}, ac="none", compile="default", compile_scope="model",
                            strategy="single", seq_len=1024, batch=16, layers=None),
    "llama8b_fp8_none_L8": dict(VARIANTS["llama8b_fp8_none"], layers=8),
}

SMOKE = dict(preset="tiny", overrides={}, ac="none", compile=None, strategy="zero3", seq_len=64, batch=2)


def _strategy(kind: str, cpu: bool) -> Any:
    from lightning_perf.strategies import ZeroStrategy

    if kind == "single":
        return "auto"
    return ZeroStrategy(stage=3, init="meta" if not cpu else "rank0", fp8_all_gather=kind == "zero3_fp8gather",
                        async_checkpoint=False)


def run_one(spec: dict[str, Any], layers: Optional[int], steps: int, cpu: bool) -> dict[str, Any]:
    """One fit in this process: the allocated bytes per phase of each step and the planner's estimate."""
    import lightning as L
    import torch

    import lightning_perf
    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPTLightningModule

    overrides = dict(spec["overrides"])
    if layers is not None:
        overrides["n_layer"] = layers
    module = GPTLightningModule(spec["preset"], config_overrides=overrides, compile=spec.get("compile"),
                                compile_scope=spec.get("compile_scope", "block"),
                                activation_checkpointing=spec["ac"], warmup_steps=1)
    data = TokenDataModule(source="synthetic", vocab_size=module.config.vocab_size, seq_len=spec["seq_len"],
                           batch_size=spec["batch"], num_workers=0)
    rows: list[dict[str, float]] = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            self.row = {"step": trainer.global_step}
            if torch.cuda.is_available() and not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.row["start"] = torch.cuda.memory_allocated()

        def on_before_backward(self, trainer, pl_module, loss):  # noqa: ANN001
            if "start" in self.row:
                torch.cuda.synchronize()
                self.row["before_backward"] = torch.cuda.memory_allocated()
                self.row["forward_peak"] = torch.cuda.max_memory_allocated()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if "start" in self.row:
                torch.cuda.synchronize()
                self.row["end"] = torch.cuda.memory_allocated()
                self.row["peak"] = torch.cuda.max_memory_allocated()
                self.row["reserved_peak"] = torch.cuda.max_memory_reserved()
            rows.append(self.row)

    from lightning_perf.plugins import PerfPrecision

    strategy = _strategy(spec["strategy"], cpu)
    precision = "32-true" if cpu else "bf16-mixed"
    # on one device the pack's precision plugin, as the CLI installs it (Lightning's refuses clipping with the
    # fused AdamW); the pack's strategies install it themselves
    plugins = [PerfPrecision(precision)] if strategy == "auto" else None
    trainer = L.Trainer(accelerator="cpu" if cpu else "gpu", devices=1, strategy=strategy, plugins=plugins,
                        precision=None if plugins else precision, max_steps=steps, logger=False,
                        enable_checkpointing=False, limit_val_batches=0, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[Probe()])
    t0 = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - t0
    estimate = lightning_perf.estimate_memory(module, trainer.strategy, devices=1, batch_size=spec["batch"],
                                              seq_len=spec["seq_len"], precision=precision)
    return {"rows": rows, "seconds": seconds, "n_layer": module.config.n_layer,
            "tokens": spec["batch"] * spec["seq_len"], "estimate": estimate.as_dict(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not cpu else "cpu"}


def _child(args: argparse.Namespace) -> None:
    """Every depth of one variant in this process (the compiled block is reused from depth to depth)."""
    import gc

    import torch

    table = {**VARIANTS, **FITS}
    spec = SMOKE if args.variant == "smoke" else table[args.variant]
    out: dict[str, Any] = {}
    for layers in args.layers or [spec.get("layers")]:
        try:
            out[str(layers or 0)] = {"ok": True, **run_one(spec, layers, args.steps, cpu=args.cpu)}
        except Exception as e:  # the other depths still run
            out[str(layers or 0)] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with open(args.json, "w") as f:
            json.dump(out, f)


def _spawn(name: str, depths: list[Optional[int]], args: argparse.Namespace, out_dir: str) -> dict[int, dict]:
    path = os.path.join(out_dir, f"run_{name}.json")
    layers = [str(d) for d in depths if d]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", name, "--steps", str(args.steps),
           "--json", path] + (["--layers", *layers] if layers else []) + (["--cpu"] if args.smoke else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {args.timeout} s: {str(e.stdout or '')[-1000:]}"
    runs: dict[int, dict] = {}
    found = {}
    if os.path.exists(path):
        with open(path) as f:
            found = json.load(f)
    for d in depths:
        run = found.get(str(d or 0), {"ok": False, "error": tail})
        run["wall_s"] = time.perf_counter() - t0
        runs[d or 0] = run
    return runs


def _measured(run: dict[str, Any]) -> Optional[dict[str, float]]:
    """The last step's figures (the optimizer state exists by then)."""
    rows = [r for r in run.get("rows", []) if "peak" in r]
    return rows[-1] if rows else None


def summarize_layers(name: str, runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-block saved activations per token from two depths, and the planner's error at each depth."""
    out: dict[str, Any] = {"variant": name, "runs": {}}
    pts = []
    for layers, run in sorted(runs.items()):
        m = _measured(run)
        entry: dict[str, Any] = {"ok": run.get("ok"), "error": run.get("error")}
        if m is not None:
            saved = m["before_backward"] - m["start"]
            pred = run["estimate"]["peak_gb"]
            entry["rows"] = run.get("rows")
            entry.update(saved_gb=saved / 1e9, peak_gb=m["peak"] / 1e9, start_gb=m["start"] / 1e9,
                         reserved_gb=m["reserved_peak"] / 1e9, predicted_peak_gb=pred,
                         peak_error=pred / (m["peak"] / 1e9) - 1, predicted_parts_gb=run["estimate"]["parts_gb"])
            pts.append((layers, saved, run["tokens"]))
        out["runs"][layers] = entry
    if len(pts) >= 2:
        (l0, s0, t), (l1, s1, _) = pts[0], pts[-1]
        out["per_block_activation_bytes_per_token"] = (s1 - s0) / (l1 - l0) / t
        out["outside_blocks_saved_bytes_per_token"] = (s0 - l0 * (s1 - s0) / (l1 - l0)) / t
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["layers", "fit"], default="layers")
    p.add_argument("--only", default=None, help="comma-separated variant names")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="depths for --part layers (default 2 4)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny preset through every code path")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    os.makedirs(args.out, exist_ok=True)
    runs_dir = os.path.join(args.out, "memory_plan_runs")
    os.makedirs(runs_dir, exist_ok=True)
    table = FITS if args.part == "fit" else VARIANTS
    names = ["smoke"] if args.smoke else (args.only.split(",") if args.only else list(table))
    unknown = [n for n in names if n != "smoke" and n not in table]
    if unknown:
        raise SystemExit(f"bench_memory_plan: unknown variants {unknown}; known: {', '.join(table)}")
    depths = args.layers or ([2, 4] if args.part == "layers" else [None])
    results = []
    for name in names:
        runs = _spawn(name, depths, args, runs_dir)
        for layers, run in runs.items():
            m = _measured(run)
            status = "failed" if not run.get("ok") else (
                f"peak {m['peak'] / 1e9:.2f} GB, predicted {run['estimate']['peak_gb']:.2f} GB, saved by the forward "
                f"{(m['before_backward'] - m['start']) / 1e9:.2f} GB" if m else "no GPU figures")
            print(f"[{name} L={layers or 'preset'}] {status} ({run['wall_s']:.0f} s for the variant)", flush=True)
            if not run.get("ok"):
                print(run.get("error", "")[-1500:], flush=True)
        results.append(summarize_layers(name, runs))
    import torch

    doc = {"benchmark": "bench_memory_plan", "part": args.part, "date": datetime.now(timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "versions": {"torch": torch.__version__}, "variants": {n: (VARIANTS.get(n) or FITS.get(n) or SMOKE)
                                                                 for n in names},
           "results": results}
    path = os.path.join(args.out, f"bench_memory_plan_{args.part}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    print(f"\n{'variant':<28} {'L':>3} {'peak GB':>8} {'pred GB':>8} {'err':>7} {'act B/tok/blk':>14}")
    for r in results:
        for layers, e in r["runs"].items():
            if e.get("peak_gb") is None:
                print(f"{r['variant']:<28} {layers:>3} {'failed':>8}")
                continue
            act = r.get("per_block_activation_bytes_per_token")
            print(f"{r['variant']:<28} {layers:>3} {e['peak_gb']:>8.2f} {e['predicted_peak_gb']:>8.2f} "
                  f"{e['peak_error']:>+7.1%} {act if act is None else round(act):>14}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
