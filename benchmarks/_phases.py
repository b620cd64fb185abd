"""A run's first and last minutes: wall-clock marks from process start to the first training step,
and from the last step to process exit, recorded by the run itself.

:class:`PhaseTimes` is a Lightning ``Profiler``: the Trainer wraps every hook it calls (the
module's ``configure_model``, ``configure_optimizers``, ``on_fit_start``, each training batch,
``save_checkpoint``, the hooks of every callback) in the profiler's ``start`` / ``stop``, so it sees
the boundaries of each phase without touching the module or the strategy. It keeps the first start
and the last stop of each action (no per-step list), synchronises the GPU at the end of the first
steps (so the first step's end is its device's end, compilation and tuning included), and writes the
marks as JSON after the first step and when the Trainer has torn down, with what torch compiled
(:func:`compile_record`). The process adds what only it knows (its start from the OS, when its
imports finished: :func:`mark`, :func:`process_start_time`); the parent that waited for it adds the
exit, and :func:`phases` turns the marks into durations.

Every mark is ``time.time()`` (seconds since the epoch), so marks taken in the parent and in the
child compare.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from lightning.pytorch.profilers import Profiler

# marks the running process takes outside the Trainer (see mark()); one process runs one fit
MARKS: dict[str, float] = {}


def mark(name: str) -> float:
    """Record ``name`` at the current wall-clock time in this process's :data:`MARKS`."""
    MARKS[name] = time.time()
    return MARKS[name]


def process_start_time(pid: Optional[int] = None) -> Optional[float]:
    """When process ``pid`` (default: this one) started, in seconds since the epoch, from Linux's
    ``/proc`` (to its clock tick, 10 ms); None where there is no ``/proc`` or it disagrees with the
    clock (a container whose ``/proc/uptime`` is not the host's)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    # the command name (field 2) may hold spaces and parentheses: fields 3.. follow its last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    now = time.time()
    start = now - (uptime - started_after_boot)
    return start if 0.0 <= now - start < 30 * 86400 else None


class PhaseTimes(Profiler):
    """Marks of one fit (see the module docstring), written to ``out`` (JSON) by global rank 0 after
    the first step and again when the Trainer tears down; :attr:`marks` holds them in the process."""

    STEP = "run_training_batch"

    def __init__(self, out: Optional[str] = None) -> None:
        super().__init__()
        self.out = out
        self.created = time.time()
        self.first_start: dict[str, float] = {}
        self.last_stop: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # summed durations of the actions worth summing (checkpoints)
        self.steps = 0
        self.step_ends: list[float] = []  # the first few steps' ends, device synchronised
        self._open: dict[str, float] = {}
        self._environment: Optional[float] = None

    def setup(self, stage: str, local_rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        # the Trainer sets its profiler up right after the strategy's environment (device, process group)
        if self._environment is None:
            self._environment = time.time()
        super().setup(stage, local_rank, log_dir)

    def start(self, action_name: str) -> None:
        t = time.time()
        self.first_start.setdefault(action_name, t)
        if action_name == "save_checkpoint":
            self._open[action_name] = t
        elif action_name.startswith("[LightningModule]") and action_name.endswith(".on_validation_start"):
            self._open["validation"] = t

    def stop(self, action_name: str) -> None:
        step = action_name == self.STEP
        if step and self.steps < 3:
            _synchronize()  # the first steps' ends are their device's ends
        t = time.time()
        self.last_stop[action_name] = t
        if action_name in self._open:
            self.seconds[action_name] = self.seconds.get(action_name, 0.0) + t - self._open.pop(action_name)
        elif "validation" in self._open and action_name.startswith("[LightningModule]") and action_name.endswith(
                ".on_validation_end"):
            which = "validation" if self.steps else "sanity_validation"  # the check before the first step
            self.seconds[which] = self.seconds.get(which, 0.0) + t - self._open.pop("validation")
        if step:
            self.steps += 1
            if self.steps <= 3:
                self.step_ends.append(t)
            if self.steps == 1:
                self.write()  # kept should the run not reach its end

    def summary(self) -> str:
        return ""  # nothing printed: the marks go to ``out``

    def describe(self) -> None:
        # the Trainer's teardown (loaders, loggers, strategy) has run: the fit is over
        self.last_stop.setdefault("trainer_teardown", time.time())
        self.write()
        super().describe()

    def _hook(self, owner: str, hook: str, which: dict[str, float]) -> Optional[float]:
        """The mark of ``[owner]<class>.<hook>`` (the Trainer's action names)."""
        prefix, suffix = f"[{owner}]", f".{hook}"
        return next((t for name, t in which.items() if name.startswith(prefix) and name.endswith(suffix)), None)

    @property
    def marks(self) -> dict[str, Any]:
        module = lambda hook, which: self._hook("LightningModule", hook, which)  # noqa: E731
        marks = {
            "trainer_built": self.created,
            "environment_ready": self._environment,
            "configure_model_start": module("configure_model", self.first_start),
            "model_built": module("configure_model", self.last_stop),
            "optimizers_built": module("configure_optimizers", self.last_stop),
            "strategy_setup_done": module("on_fit_start", self.first_start),
            "train_start": module("on_train_start", self.first_start),
            "first_step_start": self.first_start.get(self.STEP),
            "first_step_end": self.step_ends[0] if self.step_ends else None,
            "second_step_end": self.step_ends[1] if len(self.step_ends) > 1 else None,
            "third_step_end": self.step_ends[2] if len(self.step_ends) > 2 else None,
            "last_step_end": self.last_stop.get(self.STEP),
            "train_end_done": module("on_train_end", self.last_stop),
            "fit_end_done": module("on_fit_end", self.last_stop),
            "trainer_teardown": self.last_stop.get("trainer_teardown"),
        }
        return {"marks": {k: v for k, v in marks.items() if v is not None}, "steps": self.steps,
                "checkpoint_save_s": self.seconds.get("save_checkpoint", 0.0),
                "validation_s": self.seconds.get("validation", 0.0),
                "sanity_validation_s": self.seconds.get("sanity_validation", 0.0)}

    def write(self) -> None:
        if not self.out or self._local_rank not in (None, 0) or int(os.environ.get("NODE_RANK", 0)):
            return
        record = self.marks
        record["marks"].update(MARKS)
        record["compile"] = compile_record()
        start = process_start_time()
        if start is not None:
            record["marks"].setdefault("process_start", start)
        tmp = f"{self.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, self.out)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# (name, from mark, to mark): the durations a report shows, in order; a pair with a missing end is left out
SPANS = (
    ("imports_s", "process_start", "imports_done"),
    ("cli_s", "imports_done", "trainer_built"),
    ("environment_s", "trainer_built", "environment_ready"),
    ("model_build_s", "configure_model_start", "model_built"),
    ("strategy_setup_s", "model_built", "strategy_setup_done"),
    ("to_first_step_s", "strategy_setup_done", "first_step_start"),
    ("first_step_s", "first_step_start", "first_step_end"),
    ("second_step_s", "first_step_end", "second_step_end"),
    ("train_end_s", "last_step_end", "train_end_done"),  # a validation pass, the final checkpoint, end hooks
    ("teardown_s", "train_end_done", "trainer_teardown"),  # loaders, loggers, strategy, teardown hooks
    ("process_exit_s", "trainer_teardown", "process_exit"),  # the command's end: exit handlers, interpreter
)

# the two headlines: process start to the end of the first training step, last step to process exit
HEADLINES = (
    ("start_to_first_step_s", "process_start", "first_step_end"),
    ("start_to_first_step_start_s", "process_start", "first_step_start"),
    ("last_step_to_exit_s", "last_step_end", "process_exit"),
)


def phases(marks: dict[str, float]) -> dict[str, Any]:
    """Durations between ``marks`` (seconds since the epoch, as :class:`PhaseTimes` and :func:`mark` take
    them): the headlines and each span of :data:`SPANS` whose two ends were reached, and every mark as
    seconds after process start (``at_s``)."""
    out: dict[str, Any] = {}
    for name, a, b in HEADLINES + SPANS:
        if a in marks and b in marks:
            out[name] = round(marks[b] - marks[a], 3)
    start = marks.get("process_start")
    if start is not None:
        out["at_s"] = {k: round(v - start, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
    return out


# the compile stages torch times in every process (torch._dynamo.utils.compile_times), in seconds summed
# over the graphs compiled: what the first step's time went to
COMPILE_STAGES = {
    "compile_s": "_compile.compile_inner",  # all of it: Dynamo, then the backend below
    "dynamo_trace_s": "bytecode_tracing",
    "backend_s": "OutputGraph.call_user_compiler",  # AOTAutograd and Inductor
    "aot_autograd_s": "create_aot_dispatcher_function",
    "inductor_s": "compile_fx_inner",
    "kernel_build_wait_s": "async_compile.wait",  # waiting for the kernels the compile workers build
}


def compile_record() -> dict[str, Any]:
    """What torch compiled in this process: :data:`COMPILE_STAGES` and the caches' hits, misses and bypasses
    (Inductor's FX graph cache, AOTAutograd's cache), with the reasons of the bypasses :func:`watch_bypasses`
    saw."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv")
    times = dict(zip(names, values))
    out: dict[str, Any] = {}
    for label, stage in COMPILE_STAGES.items():
        if stage in times:
            out[label] = round(sum(float(v) for v in str(times[stage]).split(",") if v.strip()), 3)
    for group in ("inductor", "aot_autograd"):
        out.update({k: v for k, v in counters[group].items() if "cache" in k})
    if BYPASSES:
        out["cache_bypass_reasons"] = sorted(set(BYPASSES))[:5]
    return out


# why a compile cache was bypassed in this process (see watch_bypasses)
BYPASSES: list[str] = []


def watch_bypasses() -> None:
    """Keep the reasons torch logs when it bypasses the FX graph cache or AOTAutograd's cache."""
    import logging

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "ypass" in message:
                BYPASSES.append(" ".join(message.split())[:300])

    for name in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache"):
        logger = logging.getLogger(name)
        logger.addHandler(_Keep(level=logging.INFO))
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
