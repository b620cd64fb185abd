"""MemoryMonitor's figures checked against measured peaks on one GPU, its cost per step, and its OOM path.

1. checkpointing: gpt2-124m (bf16-mixed, eager) through the Trainer with activation checkpointing
   "none", "selective" and "full", and "none" at half the micro-batch: the saving each mode was
   predicted to give from the "none" run (``selective_saves`` / ``full_saves``, from the tensors
   autograd saved) against the measured drop of the allocated peak; the allocator's activation
   figure against the saved-tensor count; activations at half the micro-batch against half of
   them. Also whole-model compiled, where only the allocator's figures exist.
2. overhead: fits with and without MemoryMonitor (``record_history=False``; the sampled step left
   out), interleaved; median and mean step from CUDA events read after each fit.
3. oom: a micro-batch far too large; MemoryMonitor must write the snapshot and the sites, with
   stacks (history is recorded from the first step), and name them in the error.

Writes ``bench_memory.json`` to the out dir after every part (a failing part is recorded and the
rest goes on).

    python benchmarks/bench_memory.py --out $OUT       # one H100/H200, ~3 minutes
    python benchmarks/bench_memory.py --smoke          # CPU, tiny model, parts 1-2
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402

from _timing import StepTimes  # noqa: E402
from lightning_perf.callbacks import MemoryMonitor  # noqa: E402
from lightning_perf.data import TokenDataModule  # noqa: E402
from lightning_perf.models.gpt.module import GPTLightningModule  # noqa: E402

GB = 1e9


def fit(args: argparse.Namespace, *, batch: int, steps: int, callbacks: list, ac: str = "none",
        compile: Optional[str] = None, scope: str = "block") -> L.Trainer:
    module = GPTLightningModule(args.model, activation_checkpointing=ac, compile=compile, compile_scope=scope,
                                warmup_steps=2)
    data = TokenDataModule(source="synthetic", vocab_size=module.config.vocab_size, seq_len=args.seq_len,
                           batch_size=batch, num_workers=0)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=steps,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=args.logs)
    trainer.fit(module, data)
    return trainer


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_checkpointing(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for name, ac, batch, compile, scope in (("none", "none", args.batch, None, "block"),
                                            ("selective", "selective", args.batch, None, "block"),
                                            ("full", "full", args.batch, None, "block"),
                                            ("none_half_batch", "none", args.batch // 2, None, "block"),
                                            ("none_compiled_model", "none", args.batch, "default", "model")):
        if compile and args.smoke:
            continue
        mon = MemoryMonitor(sample_step=1, record_history=False)
        fit(args, batch=batch, steps=args.steps, callbacks=[mon], ac=ac, compile=compile, scope=scope)
        runs[name] = mon.report().as_dict()
        release()
    none, out = runs["none"], {"runs": runs}
    peak = "peak_allocated" if none["peak_allocated"] is not None else None
    for mode in ("selective", "full"):
        predicted = none[f"{mode}_saves"]
        measured = none[peak] - runs[mode][peak] if peak else None
        out[f"{mode}_predicted_gb"] = None if predicted is None else predicted / GB
        out[f"{mode}_measured_gb"] = None if measured is None else measured / GB
        if predicted and measured:
            out[f"{mode}_predicted_over_measured"] = predicted / measured
    if none["activations"] and runs["none_half_batch"]["activations"]:
        out["half_batch_activations_ratio"] = runs["none_half_batch"]["activations"] / none["activations"]
    if none["saved_activations"] and none["activations"]:
        out["allocator_over_saved_tensors"] = none["activations"] / none["saved_activations"]
    return out


def part_overhead(args: argparse.Namespace) -> dict[str, Any]:
    sides: dict[str, list[float]] = {"without": [], "with": []}
    skip = 5  # warm-up and MemoryMonitor's sampled step (1)
    for _ in range(args.repeats):
        for side in ("without", "with"):
            timer = StepTimes()
            callbacks = [timer] + ([MemoryMonitor(sample_step=1, record_history=False)] if side == "with" else [])
            fit(args, batch=args.batch, steps=args.overhead_steps, callbacks=callbacks)
            sides[side] += timer.timer.step_times(skip)
            release()
    out: dict[str, Any] = {}
    for side, times in sides.items():
        out[f"{side}_median_ms"] = 1e3 * statistics.median(times)
        out[f"{side}_mean_ms"] = 1e3 * statistics.fmean(times)
    out["median_overhead"] = out["with_median_ms"] / out["without_median_ms"] - 1
    out["mean_overhead"] = out["with_mean_ms"] / out["without_mean_ms"] - 1
    return out


def part_oom(args: argparse.Namespace) -> dict[str, Any]:
    mon = MemoryMonitor(sample_step=1)
    try:
        fit(args, batch=args.oom_batch, steps=2, callbacks=[mon])
    except torch.OutOfMemoryError as e:
        notes = list(getattr(e, "__notes__", []))
    else:
        return {"error": f"no OutOfMemoryError at micro-batch {args.oom_batch}"}
    finally:
        release()
    sites = None
    for f in mon.files:
        if f.endswith(".json"):
            with open(f) as fh:
                sites = json.load(fh)
    return {"files": [os.path.basename(f) for f in mon.files], "files_exist": all(os.path.exists(f) for f in mon.files),
            "snapshot_mb": (os.path.getsize(mon.files[0]) / 1e6) if mon.files else None, "notes": notes,
            "top_sites": (sites or {}).get("sites", [])[:5], "oom": (sites or {}).get("oom"),
            "with_stacks": bool(sites and any(s["via"] for s in sites.get("sites", [])))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, parts 1-2")
    p.add_argument("--parts", default="checkpointing,overhead,oom")
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--oom-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--overhead-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    args.accelerator, args.precision = "gpu", "bf16-mixed"
    parts = args.parts.split(",")
    if args.smoke:
        args.model, args.seq_len, args.batch, args.steps, args.overhead_steps, args.repeats = "tiny", 64, 8, 3, 8, 1
        args.accelerator, args.precision = "cpu", "32-true"
        parts = [x for x in parts if x != "oom"]
    warnings.filterwarnings("ignore")
    os.makedirs(args.out, exist_ok=True)
    args.logs = tempfile.mkdtemp(prefix="bench_memory_")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    result: dict[str, Any] = {
        "benchmark": "bench_memory", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": device, "torch": torch.__version__, "smoke": args.smoke,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "logs")}, "parts": {}}
    path = Path(args.out) / "bench_memory.json"
    for part in parts:
        try:
            result["parts"][part] = globals()[f"part_{part}"](args)
        except Exception:  # recorded; the other parts still run
            result["parts"][part] = {"error": traceback.format_exc()}
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"{part}: {json.dumps(result['parts'][part], default=str)[:2000]}", flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
