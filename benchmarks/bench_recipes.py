"""Each recipe as a user runs it (``lightning-perf fit --config NAME``) against a plain compiled loop.

The recipe side goes through the CLI entry point: LightningCLI, the recipe's precision, strategy,
clipping, loggers, checkpoint callback, callbacks and progress bar, on synthetic tokens for
``warmup + steps`` steps; a validation pass (the recipe's ``limit_val_batches``) and one checkpoint
save are timed after the window. The baseline, in the same call on the same GPU, is a plain PyTorch
loop over the equivalent GPT (PyTorch kernels, SDPA attention, no FP8, whole model compiled), with
the recipe's batch, sequence length, fused AdamW, bf16 autocast and gradient clipping.

Headline: tokens / wall time over the window after warm-up (the mean a user pays, slow steps
included); also the median and p90 step, the slowest steps, garbage collections and Dynamo
recompilations inside the window, peak memory and MFU against the bf16 datasheet peak.

    python benchmarks/bench_recipes.py --out $OUT                         # the single-GPU recipes
    python benchmarks/bench_recipes.py --recipes gpt2-124m --steps 60     # one recipe
    python benchmarks/bench_recipes.py --smoke                            # CPU: the code paths only

Single-GPU recipes only: a recipe with ``devices`` > 1 is refused (its baseline would be Lightning's
FSDPStrategy over the same GPUs, which this script does not build yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _timing import window_stats  # noqa: E402

PEAK_BF16 = {"h100": 989e12, "h200": 989e12}  # dense bf16 datasheet, SXM parts


def _recipe(name: str) -> dict:
    import yaml

    from lightning_perf.cli import resolve_recipe

    return yaml.safe_load(resolve_recipe(name).read_text())


def _model_config(recipe: dict):
    from lightning_perf.models import GPTLightningModule

    return GPTLightningModule(**recipe.get("model", {})).config


def _plain_config(recipe: dict):
    """The recipe's model as a plain GPT: PyTorch kernels, SDPA attention, no FP8, separate q/k/v."""
    cfg = _model_config(recipe)
    plain = {"kernels": "torch", "attention": "sdpa", "fp8": False, "fused_qkv": False}
    return dataclasses.replace(cfg, **{k: v for k, v in plain.items() if hasattr(cfg, k)})


def _smoke_overrides() -> list[str]:
    return ["--trainer.accelerator", "cpu", "--model.config", "tiny-llama", "--model.config_overrides", "null",
            "--model.compile", "null", "--data.seq_len", "64", "--data.batch_size", "4"]


def run_recipe(name: str, steps: int, warmup: int, out: Path, smoke: bool, extra: list[str]) -> None:
    """Child process: the recipe through ``lightning_perf.cli.main`` with the window callback added."""
    from lightning_perf.cli import main

    recipe = _recipe(name)
    data = recipe.get("data") or {}
    total = warmup + steps
    os.environ["BENCH_WINDOW_OUT"] = str(out)
    os.environ["BENCH_WINDOW_WARMUP"] = str(warmup)
    args = [
        "fit", "--config", name,
        "--data.source", "synthetic", "--data.data_dir", "null",
        "--data.synthetic_train_samples", str(int(data.get("batch_size", 8)) * (total + 4) * 8),
        "--trainer.max_steps", str(total),
        "--trainer.val_check_interval", str(total),
        "--trainer.default_root_dir", str(out.parent / f"run-{name}"),
        "--trainer.callbacks+=_timing.WallClockWindow",
    ]
    if smoke:
        args += _smoke_overrides()
    main(args + extra)


def run_plain(name: str, steps: int, warmup: int, out: Path, smoke: bool, extra: list[str]) -> None:
    """Child process: the plain loop over the equivalent GPT (see the module docstring)."""
    import torch

    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPT, GPTConfig

    recipe = _recipe(name)
    trainer_args, data, model_args = recipe.get("trainer") or {}, recipe.get("data") or {}, recipe.get("model") or {}
    cfg = _plain_config(recipe)
    seq_len, batch = int(data.get("seq_len", 1024)), int(data.get("batch_size", 8))
    compile_mode = "default"
    if smoke:
        cfg, seq_len, batch, compile_mode = GPTConfig.from_name("tiny-llama"), 64, 4, None
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(1234)
    with torch.device(device):
        model = GPT(cfg)
    if compile_mode:
        model = torch.compile(model, mode=compile_mode)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(model_args.get("weight_decay", 0.1))},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=float(model_args.get("learning_rate", 3e-4)), betas=(0.9, 0.95), fused=True,
    )
    clip = trainer_args.get("gradient_clip_val")
    total = warmup + steps
    dm = TokenDataModule(source="synthetic", vocab_size=cfg.vocab_size, seq_len=seq_len, batch_size=batch,
                         num_workers=int(data.get("num_workers", 0)) if not smoke else 0,
                         synthetic_train_samples=batch * (total + 4))
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    amp = device.type == "cuda" and trainer_args.get("precision", "bf16-mixed") == "bf16-mixed"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host, events, t0 = [], [], None
    for i in range(total):
        if i == warmup:
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        if t0 is not None:
            host.append(time.perf_counter())
            if device.type == "cuda":
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    sync()
    t1 = time.perf_counter()
    host.append(t1)
    times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])] or [b - a for a, b in zip(host, host[1:])]
    out.write_text(json.dumps({
        **window_stats(t1 - t0, times, batch * seq_len * steps),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
        "model": {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "kernels", "attention")},
    }, indent=2))


def _child(kind: str, name: str, args: argparse.Namespace, out: Path, extra: str = "") -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--recipes", name,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out.parent),
           f"--child_args={extra}"]
    if args.smoke:
        cmd.append("--smoke")
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    elapsed = time.perf_counter() - t
    tail = (proc.stdout[-1500:] + proc.stderr[-3000:]) if proc.returncode else ""
    if proc.returncode or not out.is_file():
        print(f"[{kind} {name}] failed (rc={proc.returncode}):\n{tail}", flush=True)
        return {"error": tail or "no result written", "process_s": elapsed}
    result = json.loads(out.read_text())
    result["process_s"] = elapsed
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--recipes", default="gpt2-124m,gpt-1.3b,gpt-1.3b-fp8")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no_checkpoint", action="store_true", help="skip timing one checkpoint save")
    p.add_argument("--budget_s", type=float, default=None, help="start no further run after this many seconds")
    p.add_argument("--child", choices=("recipe", "plain"))
    p.add_argument("--child_args", default="", help=argparse.SUPPRESS)
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also run each recipe with these CLI overrides, e.g. 'block=--model.compile_scope block'")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.no_checkpoint:
        os.environ["BENCH_WINDOW_CHECKPOINT"] = "0"
    if args.child:
        name = args.recipes
        target = out_dir / f"_{args.child}-{name}.json"
        (run_recipe if args.child == "recipe" else run_plain)(name, args.steps, args.warmup, target, args.smoke,
                                                               args.child_args.split())
        return

    import torch

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    kind = next((k for k in PEAK_BF16 if k in device_name.lower()), "cpu")
    rows: list = []
    plain_cache: dict = {}
    started = time.perf_counter()
    stamp = datetime.date.today().strftime("%Y%m%d")
    path = out_dir / f"bench_recipes_{kind}_{stamp}{'_' + args.tag if args.tag else ''}.json"

    def over_budget() -> bool:
        return args.budget_s is not None and time.perf_counter() - started > args.budget_s

    def write() -> None:
        path.write_text(json.dumps({
            "benchmark": "bench_recipes",
            "device": device_name,
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "steps": args.steps,
            "warmup": args.warmup,
            "headline": "tokens / wall-clock seconds over the timed window (mean)",
            "rows": rows,
        }, indent=2))

    names = [n for n in args.recipes.split(",") if n]
    for name in names:
        devices = (_recipe(name).get("trainer") or {}).get("devices", 1)
        if devices not in (1, "1", None) and not args.smoke:
            raise SystemExit(f"{name} asks for devices={devices}: bench_recipes.py measures single-GPU recipes only")
    for name in names:
        recipe = _recipe(name)
        cfg = _model_config(recipe)
        data = recipe.get("data") or {}
        seq_len = 64 if args.smoke else int(data.get("seq_len", 1024))
        row: dict = {"name": name}
        rows.append(row)
        plain_key = json.dumps([dataclasses.asdict(_plain_config(recipe)), data.get("seq_len"), data.get("batch_size"),
                                (recipe.get("trainer") or {}).get("gradient_clip_val")], default=str)
        for side in ("plain", "recipe"):
            if over_budget():
                row[side] = {"error": "skipped: --budget_s reached"}
                continue
            if side == "plain" and plain_key in plain_cache:
                row[side] = dict(plain_cache[plain_key], same_as=plain_cache[plain_key]["recipe"])
                continue
            target = out_dir / f"_{side}-{name}.json"
            target.unlink(missing_ok=True)
            row[side] = _child(side, name, args, target)
            if side == "plain" and "tokens_per_s" in row[side]:
                plain_cache[plain_key] = dict(row[side], recipe=name)
            target.unlink(missing_ok=True)
            print(f"[{name}] {side}: " + json.dumps({k: row[side].get(k) for k in
                  ("tokens_per_s", "step_ms_mean", "step_ms_median", "step_ms_p90", "peak_mem_gb")}), flush=True)
        write()
        for spec in args.variant:
            label, _, extra = spec.partition("=")
            if over_budget():
                break
            target = out_dir / f"_recipe-{name}.json"
            target.unlink(missing_ok=True)
            result = _child("recipe", name, args, target, extra)
            target.unlink(missing_ok=True)
            result["args"] = extra
            if "tokens_per_s" in result and "tokens_per_s" in row["plain"]:
                result["vs_plain"] = result["tokens_per_s"] / row["plain"]["tokens_per_s"]
            row.setdefault("variants", {})[label] = result
            print(f"[{name}] variant {label}: " + json.dumps({k: result.get(k) for k in
                  ("tokens_per_s", "vs_plain", "step_ms_median", "step_ms_p90", "peak_mem_gb")}), flush=True)
        if "tokens_per_s" in row["plain"] and "tokens_per_s" in row["recipe"]:
            row["recipe_vs_plain"] = row["recipe"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            if kind in PEAK_BF16 and not args.smoke:
                fpt = cfg.flops_per_token(seq_len)
                row["mfu_recipe"] = fpt * row["recipe"]["tokens_per_s"] / PEAK_BF16[kind]
                row["mfu_plain"] = fpt * row["plain"]["tokens_per_s"] / PEAK_BF16[kind]
            print(f"[{name}] recipe / plain = {row['recipe_vs_plain']:.3f}", flush=True)
        write()
    write()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
