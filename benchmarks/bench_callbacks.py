"""Cost and findings of the performance callbacks on GPT-2 124M through the Lightning Trainer, same run.

1. Overhead: every callback of the pack attached (sampled ones every 100 steps) against none,
   interleaved repeats; per-step times from CUDA events recorded at each batch start and
   read once at the end of each fit. Overhead = median step with callbacks / without - 1
   (unsampled steps), and the same on mean step time (sampled steps amortised).
2. Planted faults: a ``.item()`` in ``training_step`` (SyncPointWarner must name its line) and
   a dataset that sleeps (DataLoaderStallDetector must report the stall and warn).
3. Side by side with Lightning's ThroughputMonitor in one fit: both MFU figures and the peak
   each one used (Lightning's table has no entry for a GPU named plainly "NVIDIA H200").

Writes ``bench_callbacks.json`` and the roofline PNG to the out dir; one failing part is
recorded in the JSON and the rest goes on.

    python benchmarks/bench_callbacks.py --out $OUT        # one H100/H200, ~3-4 minutes
    python benchmarks/bench_callbacks.py --smoke           # CPU, tiny, checks the code paths
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import os
import shutil
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ThroughputMonitor  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402

from lightning_perf.callbacks import (  # noqa: E402
    CommOverlapMonitor,
    DataLoaderStallDetector,
    MFUMonitor,
    PerfReport,
    RooflineMonitor,
    SyncPointWarner,
    SyncPointWarning,
)
from _timing import StepTimes  # noqa: E402
from lightning_perf.data import TokenDataModule  # noqa: E402
from lightning_perf.models.gpt.module import GPTLightningModule  # noqa: E402

HERE = Path(__file__).resolve()
CPU_PEAKS = dict(peak_flops=1e11, peak_bandwidth=2e10)  # --smoke only: a rough CPU, so MFU/roofline have numbers




class HookTimer:
    """Host time spent inside the given callbacks' hooks, per training step (wraps their bound methods)."""

    HOOKS = ("on_train_start", "on_train_batch_start", "on_train_batch_end", "on_train_end", "on_fit_end")

    def __init__(self, step_times: StepTimes, callbacks: list) -> None:
        self.steps = step_times
        self.per_step: dict[int, float] = {}
        self.per_callback: dict[str, dict[int, float]] = {}
        for cb in callbacks:
            for hook in self.HOOKS:
                setattr(cb, hook, self._wrap(getattr(cb, hook), type(cb).__name__))

    def _wrap(self, method: Callable, owner: str) -> Callable:
        mine = self.per_callback.setdefault(owner, {})

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                step = len(self.steps.timer.marks) - 1
                self.per_step[step] = self.per_step.get(step, 0.0) + dt
                mine[step] = mine.get(step, 0.0) + dt

        return timed

    def median_us(self, times: dict[int, float], keep: Callable[[int], bool]) -> Optional[float]:
        values = [t for k, t in times.items() if keep(k)]
        return 1e6 * statistics.median(values) if values else None


class PlantedItem(GPTLightningModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:  # PLANTED-ITEM: a host-device sync every step
            raise RuntimeError("diverged")
        return loss


class SleepyTokens(Dataset):
    """Random (inputs, targets) rows; each batch of ``batch_size`` rows sleeps ``batch_sleep`` seconds."""

    def __init__(self, n: int, seq_len: int, vocab: int, batch_size: int, batch_sleep: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        self.sleep = batch_sleep / batch_size

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        time.sleep(self.sleep)
        return self.rows[i, :-1], self.rows[i, 1:]


def planted_line() -> str:
    with open(HERE) as f:
        n = next(i for i, line in enumerate(f, 1) if "PLANTED-ITEM:" in line and "next(" not in line)
    return f"{HERE.name}:{n}"


def trainer_for(cfg: dict[str, Any], callbacks: list, root: str, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator=cfg["accelerator"], devices=1, precision=cfg["precision"], max_steps=steps,
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
    )


def module_for(cfg: dict[str, Any], cls: type = GPTLightningModule) -> L.LightningModule:
    torch.manual_seed(0)
    return cls(cfg["preset"], block_size=cfg["seq_len"], compile=cfg["compile"], warmup_steps=10)


def data_for(cfg: dict[str, Any], steps: int) -> TokenDataModule:
    return TokenDataModule(source="synthetic", vocab_size=cfg["vocab"], seq_len=cfg["seq_len"],
                           batch_size=cfg["batch"], synthetic_train_samples=cfg["batch"] * (steps + 8),
                           synthetic_val_samples=cfg["batch"])


def all_callbacks(cfg: dict[str, Any]) -> list:
    peaks = {} if cfg["accelerator"] == "gpu" else CPU_PEAKS
    every, steps = cfg["sample_every"], cfg["steps"]
    return [
        MFUMonitor(peak_flops=peaks.get("peak_flops")),
        DataLoaderStallDetector(),
        SyncPointWarner(every_n_steps=every, start_step=every // 2),
        RooflineMonitor(start_step=min(every, steps - 3), **peaks),
        CommOverlapMonitor(every_n_steps=every),
        PerfReport(print_report=False),
    ]


def run_fit(cfg: dict[str, Any], name: str, callbacks: list, steps: int, module: Any = None, data: Any = None,
            ) -> tuple[L.Trainer, StepTimes]:
    timer = StepTimes()
    root = os.path.join(cfg["out"], "bench_callbacks_logs", name)
    trainer = trainer_for(cfg, [timer, *callbacks], root, steps)
    trainer.fit(module or module_for(cfg), datamodule=data if data is not None else data_for(cfg, steps))
    return trainer, timer


def part_overhead(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    steps, skip = cfg["steps"], cfg["warmup"]
    per: dict[str, list[list[float]]] = {"none": [], "all": []}
    report_files: list[str] = []
    for r in range(cfg["repeats"]):
        order = ("none", "all") if r % 2 == 0 else ("all", "none")
        for variant in order:
            cbs = all_callbacks(cfg) if variant == "all" else []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer, timer = run_fit(cfg, f"{variant}{r}", cbs, steps)
            per[variant].append(timer.step_times(skip))
            times = per[variant][-1]
            res.setdefault("runs", []).append({
                "variant": variant, "repeat": r, "median_ms": 1e3 * statistics.median(times),
                "mean_ms": 1e3 * statistics.fmean(times),
                "median_ms_per_20_steps": [round(1e3 * statistics.median(times[i:i + 20]), 3)
                                           for i in range(0, len(times), 20)],
            })
            if variant == "all":
                roof = next(cb for cb in cbs if isinstance(cb, RooflineMonitor))
                report = next(cb for cb in cbs if isinstance(cb, PerfReport))
                mfu = next(cb for cb in cbs if isinstance(cb, MFUMonitor))
                res.setdefault("all_callbacks_runs", []).append({
                    "mfu": mfu.summary(), "roofline_bound": roof.results[-1]["bound"] if roof.results else None,
                    "report": report.summary.as_dict() if report.summary else None,
                })
                report_files += report.files + roof.files
            del trainer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    # one more fit with every callback's hooks timed on the host: the deterministic part of the cost
    cbs = all_callbacks(cfg)
    timer = StepTimes()
    hooks = HookTimer(timer, cbs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_for(cfg, [timer, *cbs], os.path.join(cfg["out"], "bench_callbacks_logs", "hooks"), steps)
        trainer.fit(module_for(cfg), datamodule=data_for(cfg, steps))
    sampled = set()
    for cb in cbs:
        sampled.update(getattr(cb, "sampled_steps", []) or [])
    keep = lambda k: skip <= k < steps - 1 and k not in sampled  # noqa: E731
    host = [t for k, t in hooks.per_step.items() if keep(k)]
    per_callback_us = {name: hooks.median_us(times, keep) for name, times in hooks.per_callback.items()}
    sampled_host = {k: t for k, t in hooks.per_step.items() if k in sampled}
    del trainer
    gc.collect()

    med = {v: statistics.median([t for run in runs for t in run]) for v, runs in per.items()}
    run_medians = {v: [statistics.median(run) for run in runs] for v, runs in per.items()}
    mean = {v: statistics.fmean([t for run in runs for t in run]) for v, runs in per.items()}
    res["overhead"] = {
        "steps_per_fit": steps, "warmup_steps_dropped": skip, "repeats": cfg["repeats"],
        "median_step_ms": {v: 1e3 * m for v, m in med.items()},
        "mean_step_ms": {v: 1e3 * m for v, m in mean.items()},
        "p10_p90_step_ms": {v: [1e3 * q for q in statistics.quantiles([t for run in runs for t in run], n=10)[::8]]
                            for v, runs in per.items()},
        "overhead_median_pct": 100 * (med["all"] / med["none"] - 1),
        "overhead_mean_pct": 100 * (mean["all"] / mean["none"] - 1),
        "per_repeat_overhead_median_pct": [100 * (statistics.median(a) / statistics.median(n) - 1)
                                           for a, n in zip(per["all"], per["none"])],
        "median_of_per_repeat_overhead_pct": statistics.median(
            [100 * (statistics.median(a) / statistics.median(n) - 1) for a, n in zip(per["all"], per["none"])]),
        # A/A: how far apart fits of the same variant land (run-to-run noise of this machine)
        "aa_spread_none_pct": 100 * (max(run_medians["none"]) - min(run_medians["none"])) / med["none"],
        "callback_host_us_per_step_median": 1e6 * statistics.median(host) if host else None,
        "callback_host_pct_of_step": 100 * statistics.median(host) / med["none"] if host else None,
        "callback_host_us_per_step_by_callback": per_callback_us,
        "sampled_steps": sorted(sampled),
        "sampled_step_host_ms": {str(k): 1e3 * v for k, v in sorted(sampled_host.items())},
        "note": "overhead_median_pct compares pooled medians of unsampled-dominated steps; the A/A spread "
                "of the 'none' fits is this machine's noise floor; callback_host_* is the host time spent "
                "inside the callbacks' hooks on unsampled steps (their whole per-step cost when the loop "
                "syncs every step)",
    }
    o = res["overhead"]
    o["within_1pct"] = o["overhead_median_pct"] <= 1.0
    o["host_cost_within_1pct"] = o["callback_host_pct_of_step"] is not None and o["callback_host_pct_of_step"] <= 1.0
    for path in report_files:
        if path and os.path.exists(path):
            shutil.copy(path, os.path.join(cfg["out"], "bench_callbacks_" + os.path.basename(path)))


def part_planted_item(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    warner = SyncPointWarner(every_n_steps=10, start_step=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_fit(cfg, "planted_item", [warner], cfg["fault_steps"], module=module_for(cfg, PlantedItem))
    line = planted_line()
    messages = [str(w.message) for w in caught if issubclass(w.category, SyncPointWarning)]
    res["planted_item"] = {
        "expected_site": line,
        "detected": any(line in s.location for s in warner.user_sites()),
        "warning_emitted": any(line in m for m in messages),
        "user_sites": [s.describe() for s in warner.user_sites()],
        "framework_sites": [s.describe() for s in warner.framework_sites()],
        "sampled_steps": warner.sampled_steps,
    }


def part_slow_data(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    base = res.get("overhead", {}).get("median_step_ms", {}).get("none", 50.0) / 1e3
    sleep = 1.5 * base  # longer than a step: the GPU queue cannot hide all of it
    n = cfg["batch"] * (cfg["fault_steps"] + 4)
    ds = SleepyTokens(n, cfg["seq_len"], cfg["vocab"], cfg["batch"], sleep)
    loader = DataLoader(ds, batch_size=cfg["batch"], pin_memory=cfg["accelerator"] == "gpu")

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return loader

    det = DataLoaderStallDetector(window=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, timer = run_fit(cfg, "slow_data", [det], cfg["fault_steps"], data=Data())
    step = statistics.median(timer.step_times(cfg["fault_warmup"]))
    res["slow_data"] = {
        "injected_sleep_ms": 1e3 * sleep, "median_step_ms": 1e3 * step,
        "injected_fraction_of_step": sleep / step,
        "reported_stall_fraction": det.stall_fraction, "reported_mean_wait_ms": 1e3 * det.mean_wait_s,
        "reported_window_fractions": det.fractions,
        "detected": det.warned and det.stall_fraction > det.threshold,
        "warning": next((str(w.message) for w in caught if "DataLoaderStallDetector" in str(w.message)), None),
    }


def part_side_by_side(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    peaks = {} if cfg["accelerator"] == "gpu" else CPU_PEAKS
    mfu = MFUMonitor(peak_flops=peaks.get("peak_flops"), measure_ceiling=True)
    tm = ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel(),
                           window_size=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_fit(cfg, "side_by_side", [mfu, tm], cfg["side_steps"])
    lightning_metrics = {}
    throughput = tm._throughputs.get(RunningStage.TRAINING)
    if throughput is not None:
        lightning_metrics = {k: float(v) for k, v in throughput.compute().items()}
    ours = mfu.summary()
    res["side_by_side"] = {
        "ours": ours,
        "ours_peak_tflops": (ours.get("peak_flops") or 0) / 1e12 or None,
        "lightning": lightning_metrics,
        "lightning_peak_tflops": (tm.available_flops or 0) / 1e12 or None,
        "lightning_mfu": lightning_metrics.get("device/mfu"),
        "lightning_warnings": [str(w.message) for w in caught if "FLOPs" in str(w.message)],
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "note": "ours counts causal attention once (6N + 6LdT) and reads events without syncing; Lightning's "
                "ThroughputMonitor synchronises every batch and uses the module's flops_per_batch",
    }


def guarded(name: str, fn: Callable, cfg: dict[str, Any], res: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        fn(cfg, res)
    except Exception as err:  # record and go on with the next part
        res.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}"
        print(f"[bench_callbacks] {name} failed: {err}", file=sys.stderr)
    res.setdefault("seconds", {})[name] = time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: exercise the code paths")
    p.add_argument("--steps", type=int, default=220, help="steps per overhead fit")
    p.add_argument("--repeats", type=int, default=5, help="interleaved (none, all) pairs")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        cfg = dict(preset="tiny", seq_len=64, batch=4, vocab=260, accelerator="cpu", precision="32-true",
                   steps=24, repeats=1, sample_every=10, warmup=4, fault_steps=14, fault_warmup=3, side_steps=24)
    else:
        cfg = dict(preset="gpt2-124m", seq_len=1024, batch=16, vocab=50257, accelerator="gpu" if cuda else "cpu",
                   precision="bf16-mixed" if cuda else "32-true", steps=args.steps, repeats=args.repeats,
                   sample_every=100, warmup=20, fault_steps=60, fault_warmup=10, side_steps=150)
    cfg.update(compile="default" if args.compile else None, out=args.out)
    res: dict[str, Any] = {
        "benchmark": "bench_callbacks",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": {"torch": torch.__version__, "lightning": L.__version__,
                     "triton": getattr(sys.modules.get("triton"), "__version__", None)},
        "config": {k: v for k, v in cfg.items() if k != "out"},
    }
    try:
        import triton

        res["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    for name, fn in (("overhead", part_overhead), ("planted_item", part_planted_item),
                     ("slow_data", part_slow_data), ("side_by_side", part_side_by_side)):
        guarded(name, fn, cfg, res)
    pngs = sorted(glob.glob(os.path.join(args.out, "bench_callbacks_logs", "all*", "roofline_step*.png")))
    if pngs:
        shutil.copy(pngs[0], os.path.join(args.out, "bench_callbacks_roofline.png"))
    path = os.path.join(args.out, "bench_callbacks.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=2, default=str)
    print_table(res, path)


def print_table(res: dict[str, Any], path: str) -> None:
    o, pi, sd, sbs = (res.get(k, {}) for k in ("overhead", "planted_item", "slow_data", "side_by_side"))
    print(f"\nbench_callbacks on {res['device']} ({res['config']['preset']}, T={res['config']['seq_len']}, "
          f"B={res['config']['batch']}, {res['config']['precision']})")
    if o:
        print(f"  step median ms: none {o['median_step_ms']['none']:.2f} | all {o['median_step_ms']['all']:.2f} "
              f"-> overhead {o['overhead_median_pct']:+.2f}% (A/A spread {o['aa_spread_none_pct']:.2f}%; "
              f"mean incl. sampled steps {o['overhead_mean_pct']:+.2f}%)")
        if o.get("callback_host_us_per_step_median") is not None:
            print(f"  callbacks' host time per unsampled step: {o['callback_host_us_per_step_median']:.0f} us = "
                  f"{o['callback_host_pct_of_step']:.2f}% of a step (<= 1%: {o['host_cost_within_1pct']})")
    if pi:
        print(f"  planted .item() at {pi['expected_site']}: detected {pi['detected']}")
    if sd:
        print(f"  slow dataset: injected {sd['injected_fraction_of_step']:.1%} of step, reported stall "
              f"{sd['reported_stall_fraction']:.1%}, detected {sd['detected']}")
    if sbs:
        ours = sbs.get("ours", {})
        mfu = ours.get("mfu")
        print(f"  MFU ours {mfu if mfu is None else f'{mfu:.1%}'} (peak {sbs.get('ours_peak_tflops')} TFLOP/s; "
              f"vs matmul ceiling {ours.get('mfu_ceiling')}) | Lightning ThroughputMonitor "
              f"{sbs.get('lightning_mfu')} (peak {sbs.get('lightning_peak_tflops')})")
    for name, err in res.get("errors", {}).items():
        print(f"  ERROR in {name}: {err.splitlines()[0]}")
    print(f"  -> {path}")


if __name__ == "__main__":
    main()
