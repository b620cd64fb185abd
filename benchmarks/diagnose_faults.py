"""Planted faults against the pack's diagnostics, each through a Lightning Trainer; one JSON of expected vs reported.

1. syncs: a small model of its own (embedding, MLP blocks, head) whose training_step plants one
   host-device sync of each kind (``--kinds`` picks them): .item(), .tolist(), bool(), .cpu(), a
   non-blocking copy from pageable memory, nonzero, a boolean mask, synchronize() of the device,
   a stream (CUDA) and an event (CUDA). SyncPointWarner runs under each detector (auto, dispatch,
   both on a GPU; auto on a CPU); for each plant: the expected file:line and kind against the
   sites reported there, and the framework's own sites beside them.
2. stall + MFU: the same model on a dataset that sleeps a known time per batch, with
   SyncPointWarner, DataLoaderStallDetector, MFUMonitor, PerfReport, RooflineMonitor(traces=True)
   and MemoryMonitor when the package has it. The data-wait share expected (sleeps / host-clock
   wall time of the measured steps) against the detector's and the report's; MFU from MFUMonitor,
   from PerfReport and by hand (model FLOPs per step from the shapes, wall time of the same steps
   from the host clock); the files that appeared in the log dir next to the report (traces,
   memory snapshot).
3. flight recorder: RankWatchdog's settings, a one-rank group (NCCL on a GPU, gloo on a CPU), two
   collectives, this rank's dump, and torch's analyser run on it (NCCL dumps only).
4. oom (GPU only): a batch sized so that one activation needs 1.5x the GPU's memory, in its own
   Trainer.fit inside try/except: the error and what appeared in its log dir.
5. rank_faults: two rank processes (NCCL, one GPU each, with 2 GPUs or more; gloo CPU processes under
   --smoke or with fewer) train a small GPT under ZeroStrategy(stage=3, timeout=30 s on GPUs, 20 s on
   the CPU) with RankWatchdog and a checkpoint every 2 steps; rank 1 is killed mid-step, killed inside
   a checkpoint write, frozen with SIGSTOP, and rank 0 (the store's host) is killed. For each survivor:
   exit code and what ended it (the pack's watchdog or error, NCCL's abort, a hang), whether NCCL's
   watchdog timed its collective out first and whether the pack's lines end its log, seconds from the
   fault to its exit against the timeout, whether its error names the rank, a collective and a step,
   the flight recorder's dump and its reading; then whether the newest complete checkpoint loads into
   a fresh module, and its step (``_rank_faults.py``).

The JSON (``diagnose_faults.json`` in ``--out``) is rewritten after every part; a failing part is
recorded in it and the rest goes on.

    python benchmarks/diagnose_faults.py --out $OUT        # one H100/H200, about 3 minutes (rank_faults on gloo)
    python benchmarks/diagnose_faults.py --smoke           # CPU, tiny, about a minute with rank_faults
    python benchmarks/diagnose_faults.py --parts rank_faults --smoke      # rank_faults alone on the CPU (gloo)
    python benchmarks/diagnose_faults.py --parts rank_faults --out $OUT   # 2+ GPUs, NCCL, about 4 minutes on 2
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _rank_faults  # noqa: E402

import lightning as L  # noqa: E402

from lightning_perf.callbacks import (  # noqa: E402
    DataLoaderStallDetector,
    MFUMonitor,
    PerfReport,
    RankWatchdog,
    RooflineMonitor,
    SyncPointWarner,
    SyncPointWarning,
)
from lightning_perf.parallel.reliability.flight_recorder import dump_flight_recorder  # noqa: E402
from lightning_perf.perf.trace import load_trace  # noqa: E402

try:
    from lightning_perf.callbacks import MemoryMonitor  # noqa: E402
except ImportError:
    MemoryMonitor = None

HERE = Path(__file__).resolve()
CPU_PEAKS = dict(peak_flops=1e11, peak_bandwidth=2e10)  # --smoke only: a rough CPU, so MFU/roofline have numbers

# plant -> the kind SyncPointWarner must give it
PLANTS = {
    "item": "scalar", "tolist": "scalar", "bool": "scalar", "cpu": "d2h_copy", "pageable_h2d": "pageable_h2d",
    "nonzero": "data_dependent", "mask": "data_dependent", "device_synchronize": "synchronize",
    "stream_synchronize": "synchronize", "event_synchronize": "synchronize",
}
CUDA_ONLY = {"stream_synchronize", "event_synchronize"}


def plant_line(name: str) -> int:
    with open(HERE) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# PLANT:{name}"))


class FaultModel(L.LightningModule):
    """Embedding -> ``layers`` x (Linear(d, 4d) -> GELU -> Linear(4d, d)) -> Linear(d, vocab), no biases.

    Model FLOPs per token (forward + backward) = 6 * (8 * layers * d^2 + d * vocab): the matmul
    weights once forward, twice backward; the embedding lookup and the loss count nothing.
    Deliberately no ``flops_per_token``: MFUMonitor counts them itself.
    """

    def __init__(self, *, vocab: int, d: int, layers: int, plants: frozenset = frozenset()) -> None:
        super().__init__()
        self.vocab, self.d, self.layers = vocab, d, layers
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(),
                                                  nn.Linear(4 * d, d, bias=False)) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.plants = plants
        self.host = torch.randn(256, 1024)  # 1 MB of pageable host memory (a plain attribute: stays on the host)

    def model_flops_per_token(self) -> int:
        return 6 * (8 * self.layers * self.d ** 2 + self.d * self.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, d)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # (B, T, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.float().view(-1, self.vocab), y.reshape(-1))
        if self.plants:
            self._plant(loss.detach(), logits.detach(), y)
        return loss

    def _plant(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        p = self.plants
        if "item" in p:
            loss.item()  # PLANT:item
        if "tolist" in p:
            logits[0, 0, :4].tolist()  # PLANT:tolist
        if "bool" in p:
            if loss > 1e9:  # PLANT:bool
                raise RuntimeError("diverged")
        if "cpu" in p:
            logits[0, 0].cpu()  # PLANT:cpu
        if "pageable_h2d" in p:
            self.host.to(self.device, non_blocking=True)  # PLANT:pageable_h2d
        if "nonzero" in p:
            torch.nonzero(y[0] == 0)  # PLANT:nonzero
        if "mask" in p:
            logits[0][y[0] == 0]  # PLANT:mask
        if "device_synchronize" in p:
            getattr(torch, self.device.type).synchronize()  # PLANT:device_synchronize
        if "stream_synchronize" in p and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # PLANT:stream_synchronize
        if "event_synchronize" in p and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            event.synchronize()  # PLANT:event_synchronize

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.device.type == "cuda")


class SleepyBatches(Dataset):
    """Whole batches of random tokens (use with ``batch_size=None``); each fetch sleeps ``sleep`` seconds."""

    def __init__(self, n: int, batch: int, seq_len: int, vocab: int, sleep: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        self.n, self.sleep = n, sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep:
            time.sleep(self.sleep)
        return self.rows[:, :-1], self.rows[:, 1:]


class HostSteps(L.Callback):
    """Host clock at every batch start and end: step i = start(i+1) - start(i), the last step
    start to end (the pack's step). With ``first`` the device is drained before the start of that
    step and after the last step, so a sum over steps from ``first`` on is the device's time too."""

    def __init__(self, first: Optional[int] = None) -> None:
        self.first = first
        self.starts: list[float] = []
        self.end = 0.0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if len(self.starts) == self.first:
            self._sync()
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.starts) == trainer.max_steps:
            if self.first is not None:
                self._sync()
            self.end = time.perf_counter()

    def steps(self) -> dict[int, float]:
        out = {i: b - a for i, (a, b) in enumerate(zip(self.starts, self.starts[1:]))}
        if self.starts and self.end:
            out[len(self.starts) - 1] = self.end - self.starts[-1]
        return out


def fit(cfg: dict[str, Any], name: str, callbacks: list, *, steps: int, plants: frozenset, sleep: float = 0.0,
        batch: Optional[int] = None) -> tuple[L.Trainer, FaultModel, str]:
    root = os.path.join(cfg["out"], "diagnose_faults_logs", name)
    torch.manual_seed(0)
    model = FaultModel(vocab=cfg["vocab"], d=cfg["d"], layers=cfg["layers"], plants=plants)
    data = DataLoader(SleepyBatches(steps + 2, batch or cfg["batch"], cfg["seq_len"], cfg["vocab"], sleep),
                      batch_size=None)
    trainer = L.Trainer(accelerator=cfg["accelerator"], devices=1, precision=cfg["precision"], max_steps=steps,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=root)
    trainer.fit(model, data)
    return trainer, model, root


def short(location: str) -> str:
    path, _, line = location.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def compare_plants(warner: SyncPointWarner, plants: frozenset, cuda: bool) -> dict[str, Any]:
    sites = warner.user_sites() + warner.framework_sites()
    out: dict[str, Any] = {}
    planted_lines = set()
    for name in sorted(PLANTS):
        line = plant_line(name)
        planted_lines.add(line)
        here = [s for s in sites if s.location == f"{HERE}:{line}"]
        row: dict[str, Any] = {"expected": f"{HERE.name}:{line}", "expected_kind": PLANTS[name],
                               "planted": name in plants and (cuda or name not in CUDA_ONLY),
                               "reported": [{"location": short(s.location), "kind": s.kind, "op": s.op,
                                             "owner": s.owner, "count": s.count} for s in here]}
        row["found"] = any(s.kind == PLANTS[name] for s in here)
        out[name] = row
    unexpected = [s for s in warner.user_sites()
                  if not (s.location.startswith(f"{HERE}:") and int(s.location.rpartition(":")[2]) in planted_lines)]
    planted = [r for r in out.values() if r["planted"]]
    return {
        "plants": out,
        "found": sum(r["found"] for r in planted), "planted": len(planted),
        "all_found": all(r["found"] for r in planted),
        "false_positives": [s.describe() for s in unexpected],
        "framework_sites": [s.describe() for s in warner.framework_sites()],
        "sampled_steps": warner.sampled_steps,
    }


# ---- parts ------------------------------------------------------------------------------------------

def part_syncs(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    detectors = ("auto", "dispatch", "both") if cfg["accelerator"] == "gpu" else ("auto",)
    plants = frozenset(cfg["kinds"])
    for detector in detectors:
        warner = SyncPointWarner(every_n_steps=0, start_step=2, detector=detector)
        clock = HostSteps()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(cfg, f"syncs_{detector}", [clock, warner], steps=5, plants=plants)
        row = compare_plants(warner, plants, cfg["accelerator"] == "gpu")
        steps = clock.steps()
        row["warnings"] = sum(issubclass(w.category, SyncPointWarning) for w in caught)
        row["watched_step_ms"] = 1e3 * steps.get(2, float("nan"))
        row["other_steps_ms"] = [round(1e3 * t, 3) for i, t in sorted(steps.items()) if i != 2]
        res.setdefault("syncs", {})[detector] = row


def part_stall_mfu(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    gpu = cfg["accelerator"] == "gpu"
    peaks = {} if gpu else CPU_PEAKS
    steps, warmup, sleep = cfg["steps"], cfg["warmup"], cfg["sleep"]
    clock = HostSteps(first=warmup)
    warner = SyncPointWarner(every_n_steps=0, start_step=4)
    stall = DataLoaderStallDetector(window=5, warmup_steps=warmup)
    mfu = MFUMonitor(peak_flops=peaks.get("peak_flops"), window=5, warmup_steps=warmup)
    roof = RooflineMonitor(start_step=8, profile_steps=2, traces=True, **peaks)
    report = PerfReport(warmup_steps=warmup, print_report=False)
    callbacks: list = [clock, warner, stall, mfu, roof, report]
    memory = None
    if MemoryMonitor is not None:
        try:
            memory = MemoryMonitor()
            callbacks.append(memory)
        except Exception as err:  # its constructor's needs are its own
            res["memory_monitor_error"] = f"{type(err).__name__}: {err}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, model, root = fit(cfg, "stall_mfu", callbacks, steps=steps, plants=frozenset(cfg["kinds"]),
                                   sleep=sleep)
    sampled = set().union(*(getattr(cb, "sampled_steps", None) or [] for cb in callbacks))
    host = clock.steps()
    measured = {i: t for i, t in host.items() if i >= warmup and i not in sampled}
    wall_s = sum(measured.values())
    last = max(host) if host else -1
    tokens = cfg["batch"] * cfg["seq_len"]
    hand_fpt = model.model_flops_per_token()
    m = mfu.summary()
    s = report.summary
    peak = mfu.peak_flops
    res["stall"] = {
        "sleep_ms": 1e3 * sleep,
        "host_step_ms_mean": 1e3 * wall_s / len(measured) if measured else None,
        # every measured step but the last waits for the next batch
        "expected_share": sleep * sum(i != last for i in measured) / wall_s if wall_s else None,
        "reported_share": stall.stall_fraction,
        "report_share": None if s is None or s.data_wait_s is None or not s.step_time_s
        else s.data_wait_s / s.step_time_s,
        "reported_window_shares": stall.fractions,
        "reported_mean_wait_ms": 1e3 * stall.mean_wait_s,
        "window": stall.summary()["window"],
        "warned": stall.warned,
        "note": "expected_share: the sleeps over the host-clock wall time of the measured steps (after warm-up, "
                "less every step a callback sampled); on a GPU only the part of the sleep the device sat idle for "
                "is exposed",
    }
    res["mfu"] = {
        "peak_flops": peak, "peak": m.get("peak"), "tokens_per_step": tokens,
        "hand": {"flops_per_token": hand_fpt, "flops_per_step": hand_fpt * tokens,
                 "step_ms": 1e3 * wall_s / len(measured) if measured else None,
                 "mfu": hand_fpt * tokens * len(measured) / wall_s / peak if peak and wall_s else None,
                 "steps": sorted(measured)},
        "mfu_monitor": {"flops_per_token": 1e12 * m["tflops_per_device"] / m["tokens_per_sec"]
                        if m.get("tokens_per_sec") and m.get("tflops_per_device") else None,
                        "step_ms": 1e3 * m["step_time_s"] if m.get("step_time_s") else None, "mfu": m.get("mfu"),
                        "mfu_note": m.get("mfu_note"), "window": m.get("window"),
                        "tokens_per_sec": m.get("tokens_per_sec")},
        "perf_report": {"mfu": None if s is None else s.mfu, "step_ms": None if s is None else 1e3 * s.step_time_s,
                        "steps": None if s is None else s.steps, "window": None if s is None else s.window,
                        "tokens_per_sec": None if s is None else s.tokens_per_sec},
        "note": "hand: model FLOPs from the shapes x tokens x measured steps over their host-clock wall time (steps "
                "after warm-up that no callback sampled; the device drained at the window's first step and at the "
                "end); MFUMonitor: the FLOPs it counted on the first batch over the same steps timed on the device; "
                "PerfReport: what it prints (MFUMonitor's measurement of its stated window)",
    }
    written = files_under(root)
    res["files_next_to_report"] = {
        "log_dir": root, "files": written,
        "chrome_trace": [f for f in written if f.startswith("trace_step") and f.endswith((".json", ".json.gz"))],
        "tensorboard_trace": [f for f in written if f.startswith("tb_trace" + os.sep)],
        "report": [f for f in written if f.startswith("perf_report")],
        "memory": [f for f in written if "mem" in f.lower() or f.endswith(".pickle")],
        "memory_monitor": None if memory is None else type(memory).__name__,
        "traces_parsed": {},
    }
    for rel in res["files_next_to_report"]["chrome_trace"] + res["files_next_to_report"]["tensorboard_trace"]:
        events = load_trace(os.path.join(root, rel)).get("traceEvents", [])
        res["files_next_to_report"]["traces_parsed"][rel] = {
            "events": len(events), "gpu_kernels": sum(e.get("cat") == "kernel" for e in events),
            "aten_mm": sum(e.get("name") == "aten::mm" for e in events)}
    res["stall_mfu_syncs"] = compare_plants(warner, frozenset(cfg["kinds"]), gpu)
    if s is not None:
        res["perf_report_summary"] = s.as_dict()


def part_flight_recorder(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    import torch.distributed as dist

    gpu = cfg["accelerator"] == "gpu"
    backend = "nccl" if gpu else "gloo"
    root = os.path.join(cfg["out"], "diagnose_faults_logs", "process_group")
    wd = RankWatchdog()
    wd.prepare_process_group(SimpleNamespace(default_root_dir=root), backend)  # before the group, as a strategy does
    env = {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                                           "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                                           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", 0)} if gpu else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        device = "cuda" if gpu else "cpu"
        t = torch.ones(1024, device=device)
        dist.all_reduce(t)
        out = torch.empty(1024, device=device)
        dist.all_gather_into_tensor(out, t) if gpu else dist.all_gather([out], t)
        if gpu:
            torch.cuda.synchronize()
        path = dump_flight_recorder(wd.dump_prefix, 0, nccl=gpu)
    finally:
        dist.destroy_process_group()
        for name in wd.flight_recorder_env:  # what the watchdog set, not left to the later parts' processes
            os.environ.pop(name, None)
    row: dict[str, Any] = {"backend": backend, "env_set_by_watchdog": wd.flight_recorder_env, "env": env,
                           "dump": path, "message": wd.describe_dumps()}
    if path:
        entries = pickle.load(open(path, "rb")).get("entries", [])
        row["entries"] = [e.get("profiling_name") for e in entries]
    if gpu and path:  # torch's analyser reads NCCL dumps (a gloo dump has no process-group config)
        folder, stem = os.path.split(wd.dump_prefix)
        cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", folder, "--prefix", stem, "-j"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        row["fr_trace"] = {"command": " ".join(cmd[1:]), "returncode": done.returncode,
                           "stdout_tail": done.stdout[-3000:], "stderr_tail": done.stderr[-2000:]}
    res["flight_recorder"] = row


def part_oom(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    if cfg["accelerator"] != "gpu":
        res["oom"] = {"skipped": "needs a GPU"}
        return
    total = torch.cuda.get_device_properties(0).total_memory
    per_sample = cfg["seq_len"] * 4 * cfg["d"] * 2  # the first block's (T, 4d) bf16 activation
    batch = int(1.5 * total / per_sample) + 1
    callbacks: list = []
    if MemoryMonitor is not None:
        try:
            callbacks.append(MemoryMonitor())
        except Exception as err:
            res["memory_monitor_error"] = f"{type(err).__name__}: {err}"
    torch.cuda.reset_peak_memory_stats()
    root = os.path.join(cfg["out"], "diagnose_faults_logs", "oom")
    t0 = time.perf_counter()
    row: dict[str, Any] = {"batch": batch, "one_activation_gb": batch * per_sample / 1e9, "gpu_gb": total / 1e9}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(cfg, "oom", callbacks, steps=2, plants=frozenset(), batch=batch)
        row["raised"] = None
    except Exception as err:  # the point of this part
        row["raised"] = type(err).__name__
        row["is_out_of_memory"] = isinstance(err, torch.OutOfMemoryError)
        row["message_head"] = str(err).splitlines()[0][:400] if str(err) else ""
    row["seconds"] = time.perf_counter() - t0
    row["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    gc.collect()
    torch.cuda.empty_cache()
    row["memory_allocated_after_gb"] = torch.cuda.memory_allocated() / 1e9
    row["files"] = files_under(root) if os.path.isdir(root) else []
    row["memory_monitor"] = bool(callbacks)
    res["oom"] = row


def part_rank_faults(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    nccl = not cfg["smoke"] and torch.cuda.is_available() and torch.cuda.device_count() >= 2
    _rank_faults.run(nccl, cfg["out"], res, cfg["rank_faults"], save=lambda: write(res, cfg["path"]))
    if not nccl and not cfg["smoke"]:
        res["rank_faults"]["note"] = (f"gloo CPU processes: {torch.cuda.device_count()} GPU(s) here, NCCL needs 2")


# ---- driver -----------------------------------------------------------------------------------------

def write(res: dict[str, Any], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=2, default=str)
    os.replace(tmp, path)


def guarded(name: str, fn: Callable, cfg: dict[str, Any], res: dict[str, Any], path: str) -> None:
    t0 = time.perf_counter()
    try:
        fn(cfg, res)
    except Exception as err:  # record and go on with the next part
        res.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}"
        print(f"[diagnose_faults] {name} failed: {err}", file=sys.stderr)
    res.setdefault("seconds", {})[name] = time.perf_counter() - t0
    write(res, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: exercise the code paths")
    p.add_argument("--kinds", default=",".join(PLANTS), help=f"plants to switch on, from {','.join(PLANTS)}")
    p.add_argument("--parts", default="syncs,stall_mfu,flight_recorder,oom,rank_faults")
    p.add_argument("--rank-faults", default=",".join(_rank_faults.SCENARIOS),
                   help=f"rank_faults scenarios, from {','.join(_rank_faults.SCENARIOS)}")
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(PLANTS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}; choose from {sorted(PLANTS)}")
    scenarios = [n for n in args.rank_faults.split(",") if n]
    if set(scenarios) - set(_rank_faults.SCENARIOS):
        p.error(f"unknown rank faults {sorted(set(scenarios) - set(_rank_faults.SCENARIOS))}; choose from "
                f"{sorted(_rank_faults.SCENARIOS)}")
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.is_available() and not args.smoke
    if gpu:
        cfg = dict(vocab=8192, d=1024, layers=4, seq_len=512, batch=16, steps=60, warmup=5, sleep=0.010,
                   accelerator="gpu", precision="bf16-mixed")
    else:
        cfg = dict(vocab=256, d=64, layers=2, seq_len=32, batch=8, steps=24, warmup=3, sleep=0.020,
                   accelerator="cpu", precision="32-true")
    path = os.path.join(args.out, "diagnose_faults.json")
    cfg.update(kinds=kinds, out=args.out, smoke=args.smoke, path=path, rank_faults=scenarios)
    res: dict[str, Any] = {
        "benchmark": "diagnose_faults",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "versions": {"torch": torch.__version__, "lightning": L.__version__},
        "config": {k: v for k, v in cfg.items() if k not in ("out", "path")},
        "memory_monitor_available": MemoryMonitor is not None,
    }
    parts = {"syncs": part_syncs, "stall_mfu": part_stall_mfu, "flight_recorder": part_flight_recorder,
             "oom": part_oom, "rank_faults": part_rank_faults}
    chosen = [n for n in args.parts.split(",") if n]
    if set(chosen) - set(parts):
        p.error(f"unknown parts {sorted(set(chosen) - set(parts))}; choose from {sorted(parts)}")
    for name in chosen:
        guarded(name, parts[name], cfg, res, path)
    print_summary(res, path)


def print_summary(res: dict[str, Any], path: str) -> None:
    print(f"\ndiagnose_faults on {res['device']}")
    for detector, row in res.get("syncs", {}).items():
        missed = [n for n, r in row["plants"].items() if r["planted"] and not r["found"]]
        print(f"  syncs [{detector}]: {row['found']}/{row['planted']} planted kinds at their line"
              f"{'; missed ' + ', '.join(missed) if missed else ''}; {len(row['false_positives'])} other user sites; "
              f"{len(row['framework_sites'])} framework sites")
    st = res.get("stall")
    if st:
        print(f"  stall: expected {st['expected_share']:.1%} (sleep {st['sleep_ms']:.0f} ms per step), reported "
              f"{st['reported_share']:.1%} by the detector, {st['report_share']:.1%} by the report "
              f"(mean wait {st['reported_mean_wait_ms']:.1f} ms)")
    m = res.get("mfu")
    if m:
        def pct(x: Optional[float]) -> str:
            return "n/a" if x is None else f"{x:.2%}"

        print(f"  MFU: hand {pct(m['hand']['mfu'])} | MFUMonitor {pct(m['mfu_monitor']['mfu'])} | PerfReport "
              f"{pct(m['perf_report']['mfu'])} ({m['perf_report']['window']})")
    f = res.get("files_next_to_report")
    if f:
        print(f"  next to the report: {len(f['chrome_trace'])} Chrome trace(s), {len(f['tensorboard_trace'])} "
              f"TensorBoard trace(s), memory files {f['memory']}")
    fr = res.get("flight_recorder")
    if fr:
        analysed = fr.get("fr_trace", {}).get("returncode")
        print(f"  flight recorder ({fr['backend']}): dump {fr['dump']} with {len(fr.get('entries', []))} entries; "
              f"fr_trace rc {analysed}")
    o = res.get("oom")
    if o:
        print(f"  oom: {o.get('skipped') or o.get('raised')}")
    rf = res.get("rank_faults")
    if rf:
        print(f"  rank faults ({rf.get('seconds')} s):")
        for line in _rank_faults.summary_lines(rf):
            print("    " + line)
    for name, err in res.get("errors", {}).items():
        print(f"  ERROR in {name}: {err.splitlines()[0]}")
    print(f"  -> {path}")


if __name__ == "__main__":
    main()
