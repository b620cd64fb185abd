"""The ``rank_faults`` part of ``diagnose_faults.py``: a rank of a two-rank ZeRO run killed, frozen or killed
while it saves, and what the survivor and the checkpoint folder show afterwards.

Each scenario starts two rank processes (``subprocess``, as a launcher would: ``MASTER_ADDR``, ``LOCAL_RANK``,
...), one GPU each under NCCL, or CPU processes under gloo, each training a small GPT through
``Trainer(strategy=ZeroStrategy(stage=3, timeout=...))`` with ``RankWatchdog`` and a ``ModelCheckpoint`` every
``every`` steps, and plants one fault:

- ``kill_rank1_mid_step``: rank 1 SIGKILLs itself between the forward and the backward of step ``fault_step``;
- ``kill_rank1_mid_save``: rank 1 SIGKILLs itself inside DCP's write of the checkpoint of step ``save_step``
  (``FileSystemWriter.write_data``, in the background thread where saves are asynchronous);
- ``sigstop_rank1``: rank 1 stops at the start of step ``fault_step`` and the parent sends it SIGSTOP (frozen,
  its sockets open); SIGKILL and SIGCONT at the end;
- ``kill_rank0``: rank 0, the host of the process group's TCPStore, SIGKILLs itself before the backward of step
  ``fault_step``.

Before a fault at a step every rank waits, at the start of that step, for the save in flight to be final, so the
newest complete checkpoint is known: the save of ``expected_step``. Every rank, not the victim alone: under NCCL a
rank that waits while its peer goes on into the step can wait for ever, since the peer's background save (DCP's
writer synchronizes its CUDA stream) queues behind the step's collectives, which the waiting rank never joins.
For every survivor the JSON records its exit code and what ended it (``ended_by``: the pack's watchdog, the pack's
error, NCCL's abort, the harness), whether NCCL's watchdog got as far as timing its collective out and whether C++
frames reached its log, its last lines and whether they are the pack's, the seconds from the fault to its exit
and whether that is within the strategy's ``timeout`` plus a margin (the watchdog's ``dead_after`` + 3 intervals
+ a few seconds to tear down), the end of its error and of its log and whether they name the failed rank, a
collective and a step, the flight recorder's dump (written? read back: its entries, the collective in flight;
torch's analyser on NCCL dumps). A rank that ends before the fault is planted is reported with what ended it and
where each rank was (``problem``). Then, in this process, the checkpoint folder as the next
``fit(ckpt_path="last")`` sees it: repaired and resolved by ``lightning_perf.runtime.resume``, loaded into a fresh
module and optimizer with ``lightning_perf.parallel.load_checkpoint`` (sizes and CRC-32 checked), and the step it
holds against ``expected_step``.

"Names the rank / a collective / a step" is read from the survivor's exception (what it raised) and from the
messages of its log (its unindented lines, not a traceback's frames): under NCCL a survivor blocked in a
collective raises no exception; ``RankWatchdog`` ends it and its log is what it says (``NCCL_NOTE``). Scenarios run
``parallel`` at a time, each on a GPU pair of its own (``gpu_pairs``): with one pair they run one after another.

The parent never waits on a child: every scenario has deadlines (the start, the fault, the survivors' exit), a
survivor still running at its deadline gets SIGUSR2 (its threads' stacks into its log, ``faulthandler``) and
SIGKILL, and every process still alive at the end is killed with its process group.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SCENARIOS: dict[str, dict[str, Any]] = {
    "kill_rank1_mid_step": {"victim": 1, "fault": "kill", "where": "backward"},
    "kill_rank1_mid_save": {"victim": 1, "fault": "kill", "where": "save"},
    "sigstop_rank1": {"victim": 1, "fault": "stop", "where": "batch_start"},
    "kill_rank0": {"victim": 0, "fault": "kill", "where": "backward"},
}
COLLECTIVE = re.compile(r"(?i)(all_?reduce|reduce_?scatter|all_?gather|broadcast|barrier|all_?to_?all|"
                        r"\bgather\b|\bscatter\b)")
STEP = re.compile(r"(?i)\bstep \d+")  # a log line or error naming the step
# what torch's NCCL error handling reads (the pack sets none of them: recorded as the children saw them)
NCCL_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT",
             "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


def settings(gpu: bool) -> dict[str, Any]:
    """The run: the model, the steps, the timeouts (seconds) and the deadlines of the parent."""
    common = dict(stage=3, every=2, fault_step=5, save_step=4, max_steps=9, deadline_margin=3.0)
    if gpu:
        return dict(common, backend="nccl", accelerator="gpu", precision="bf16-mixed", n_layer=4, n_embd=256,
                    n_head=4, vocab=8192, seq_len=256, batch=8, timeout=30.0, interval=0.5, dead_after=5.0,
                    teardown=10.0, start_deadline=240.0, grace=30.0, parallel=4)
    return dict(common, backend="gloo", accelerator="cpu", precision="32-true", n_layer=2, n_embd=64, n_head=2,
                vocab=128, seq_len=32, batch=2, timeout=20.0, interval=0.25, dead_after=2.0, teardown=5.0,
                start_deadline=150.0, grace=20.0, parallel=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank (a child process) -------------------------------------------------------------------


def _stamp(path: Path, **values: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(values))
    os.replace(tmp, path)


def worker_main(spec_path: str) -> None:
    """A rank: ``python -c 'import _rank_faults; _rank_faults.worker_main(spec)'`` with the launcher's variables."""
    import faulthandler
    import resource

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the parent's request for stacks before a kill
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort (NCCL's watchdog) writes no core file
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["LOCAL_RANK"])
    out = Path(spec["dir"])
    code = 0
    try:
        _train(spec, rank, out)
        result: dict[str, Any] = {"outcome": "finished", "time": time.time()}
    except BaseException as e:  # what the survivor raised: the point of the exercise
        code = 1
        traceback.print_exc()  # into its log, as an uncaught error would be
        result = {"outcome": "raised", "time": time.time(), "type": type(e).__name__, "message": str(e)[-4000:],
                  "cause": None if e.__cause__ is None else f"{type(e.__cause__).__name__}: {e.__cause__}"[-2000:],
                  "traceback_tail": traceback.format_exc()[-3000:]}
    _stamp(out / f"rank{rank}.result.json", **result)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _train(spec: dict[str, Any], rank: int, out: Path) -> None:
    import lightning as L
    import torch

    from lightning_perf.callbacks import RankWatchdog
    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPTConfig, GPTLightningModule
    from lightning_perf.strategies import ZeroStrategy

    if spec["accelerator"] == "cpu":
        torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    config = GPTConfig.from_name("tiny", n_layer=spec["n_layer"], n_embd=spec["n_embd"], n_head=spec["n_head"],
                                 block_size=spec["seq_len"], vocab_size=spec["vocab"], bias=False)
    module = GPTLightningModule(config, learning_rate=1e-3, warmup_steps=0, min_lr_ratio=1.0)
    samples = (spec["max_steps"] + 2) * spec["batch"] * 2
    data = TokenDataModule(source="synthetic", vocab_size=spec["vocab"], seq_len=spec["seq_len"],
                           batch_size=spec["batch"], seed=0, synthetic_train_samples=samples,
                           synthetic_val_samples=spec["batch"])
    watchdog = RankWatchdog(interval=spec["interval"], dead_after=spec["dead_after"],
                            deadline_margin=spec["deadline_margin"], dump_dir=str(out / "flight_recorder"))
    callbacks: list = [
        watchdog,
        _Setup(watchdog, out, rank),
        L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=spec["every"],
                                            save_last=True),
    ]
    if spec["where"] != "save":
        callbacks.append(_Settle(spec["fault_step"], out, rank))
    if rank == spec["victim"]:
        callbacks.append(_Plant(spec, out))
    trainer = L.Trainer(accelerator=spec["accelerator"], devices=2, precision=spec["precision"],
                        strategy=ZeroStrategy(stage=spec["stage"], timeout=spec["timeout"]),
                        max_steps=spec["max_steps"], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=callbacks, default_root_dir=str(out))
    trainer.fit(module, data)


def _callback_base():
    import lightning as L

    return L.Callback


class _Setup(_callback_base()):  # type: ignore[misc]
    """Records, once the process group exists, what the parent needs: the dump prefix, the NCCL variables."""

    def __init__(self, watchdog: Any, out: Path, rank: int) -> None:
        self.watchdog, self.out, self.rank = watchdog, out, rank

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed as dist

        _stamp(self.out / f"rank{self.rank}.setup.json", pid=os.getpid(), dump_prefix=self.watchdog.dump_prefix,
               backend=dist.get_backend() if dist.is_initialized() else None,
               set_by_watchdog=self.watchdog.flight_recorder_env,
               env={k: os.environ.get(k) for k in NCCL_VARS},
               async_checkpoint=bool(getattr(trainer.strategy, "async_checkpoint", False)))


class _Settle(_callback_base()):  # type: ignore[misc]
    """Every rank, at the start of the fault's step: the save in flight made final (see the module docstring)."""

    def __init__(self, step: int, out: Path, rank: int) -> None:
        self.step, self.out, self.rank = step, out, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            stage = self.out / f"rank{self.rank}.stage.json"
            _stamp(stage, stage="waiting for the checkpoint in flight to be final", time=time.time(), step=self.step)
            trainer.strategy.wait_for_checkpoint()
            _stamp(stage, stage="in the fault's step, the checkpoint final", time=time.time(), step=self.step)


class _Plant(_callback_base()):  # type: ignore[misc]
    """The victim's fault (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], out: Path) -> None:
        self.spec, self.out = spec, out
        self.where = spec["where"]
        if self.where == "save":
            self._patch_write(spec["save_step"])

    def _die(self, step: int, where: str) -> None:
        _stamp(self.out / "fault.json", time=time.time(), step=step, where=where, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)

    def _patch_write(self, step: int) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        real, plant = FileSystemWriter.write_data, self

        def write_data(writer, plan, planner):  # dies inside the write of that step's checkpoint
            if f"step={step}." in str(getattr(writer, "path", "")):
                plant._die(step, f"inside FileSystemWriter.write_data of {Path(str(writer.path)).name}")
            return real(writer, plan, planner)

        FileSystemWriter.write_data = write_data

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.where == "backward" and trainer.global_step == self.spec["fault_step"]:
            self._die(trainer.global_step, "between the forward and the backward")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # after _Settle's
        if self.where == "batch_start" and trainer.global_step == self.spec["fault_step"]:
            _stamp(self.out / "ready.json", time=time.time(), step=trainer.global_step, pid=os.getpid())
            time.sleep(self.spec["timeout"] + 30)  # the parent stops this process meanwhile


# ---- the parent ------------------------------------------------------------------------------------


# each scenario's dumps go to its own folder: a dump path in this process's environment (an earlier part's) is
# not passed on
DUMP_PATH_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
NCCL_NOTE = ("the pack sets none of TORCH_NCCL_ASYNC_ERROR_HANDLING, TORCH_NCCL_BLOCKING_WAIT, "
             "TORCH_NCCL_ENABLE_MONITORING, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC and neither does this benchmark "
             "(env_seen_by_ranks): with torch's defaults NCCL's watchdog thread times a stuck collective out at its "
             "group's timeout (the strategy's), dumps the flight recorder, and about a minute later aborts the "
             "process (SIGABRT, C++ frames, no Python exception). RankWatchdog ends a survivor before that: once "
             "a peer has been silent for dead_after, deadline_margin seconds before the timeout of the collective "
             "it waits in (read from its flight recorder), or exit_after after the death was noticed, whichever "
             "is first, with its dump written and 2-3 lines logged (the rank, the collective, the dumps). "
             "ended_by says what ended each survivor; nccl_timeout_logged whether NCCL's watchdog timed its "
             "collective out first")


def gpu_pairs(count: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for scenario 0, 1, ...: two GPUs each, the next pair for the next scenario."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
        [str(i) for i in range(count)]
    visible = visible[:count] if count else visible
    pairs = [f"{visible[i]},{visible[i + 1]}" for i in range(0, len(visible) - 1, 2)]
    return pairs or [""]


@dataclass
class Scenario:
    name: str
    spec: dict[str, Any]
    dir: Path
    devices: str = ""  # CUDA_VISIBLE_DEVICES of its ranks (NCCL)
    procs: list[subprocess.Popen] = field(default_factory=list)
    started: float = 0.0
    fault_time: Optional[float] = None
    fault: dict[str, Any] = field(default_factory=dict)
    exit_times: dict[int, float] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    problem: Optional[str] = None
    done: bool = False

    @property
    def victim(self) -> int:
        return self.spec["victim"]

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(2) if r != self.victim]

    def bound(self) -> float:
        s = self.spec
        return s["timeout"] + s["dead_after"] + 3 * s["interval"] + s["teardown"]

    def start(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # an earlier run's fault record, logs and checkpoints
        self.dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.dir / "spec.json"
        spec_path.write_text(json.dumps(dict(self.spec, dir=str(self.dir))))
        port = free_port()
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import _rank_faults; _rank_faults.worker_main(sys.argv[1])"
        for rank in range(2):
            env = {k: v for k, v in os.environ.items() if k not in DUMP_PATH_VARS}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                       LOCAL_RANK=str(rank), RANK=str(rank), PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
            if self.spec["accelerator"] == "cpu":
                env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
            elif self.devices:
                env["CUDA_VISIBLE_DEVICES"] = self.devices
            log = open(self.dir / f"rank{rank}.log", "wb")
            self.procs.append(subprocess.Popen([sys.executable, "-c", code, str(spec_path)], cwd=str(ROOT),
                                               stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
            log.close()
        self.started = time.time()
        for rank, p in enumerate(self.procs):  # the exit times, whatever the parent is doing meanwhile
            threading.Thread(target=self._wait, args=(rank, p), daemon=True).start()

    def _wait(self, rank: int, p: subprocess.Popen) -> None:
        p.wait()
        self.exit_times.setdefault(rank, time.time())

    def poll(self) -> None:
        """One look at the processes: the fault, the exits, the deadlines."""
        now = time.time()
        s = self.spec
        if self.fault_time is None:
            if s["fault"] == "stop" and (self.dir / "ready.json").exists():
                os.kill(self.procs[self.victim].pid, signal.SIGSTOP)
                self.fault_time = time.time()
                self.fault = dict(json.loads((self.dir / "ready.json").read_text()), where="SIGSTOP from the parent "
                                  "at the start of the step")
            elif (self.dir / "fault.json").exists():
                self.fault = json.loads((self.dir / "fault.json").read_text())
                self.fault_time = float(self.fault["time"])
            elif self.exit_times:
                self.problem = "no fault was planted: " + self._where_ranks_were()
                self.finish()
            elif now - self.started > s["start_deadline"]:
                self.problem = (f"no fault within {s['start_deadline']:.0f} s of the start: "
                                f"{self._where_ranks_were()}")
                self.finish()
            return
        if all(r in self.exit_times for r in self.survivors):
            self.finish()
        elif now - self.fault_time > self.bound() + s["grace"]:
            self.hung = [r for r in self.survivors if r not in self.exit_times]
            for r in self.hung:  # where it hangs, into its log
                with contextlib.suppress(OSError):
                    os.kill(self.procs[r].pid, signal.SIGUSR2)
            time.sleep(2.0)
            self.finish()

    def _stage(self, rank: int) -> str:
        """Where a rank was before the fault, from the files it stamped."""
        if rank == self.victim and (self.dir / "ready.json").exists():
            return "at the start of the fault's step, ready to be stopped"
        with contextlib.suppress(OSError, ValueError, KeyError):
            stage = json.loads((self.dir / f"rank{rank}.stage.json").read_text())
            return f"{stage['stage']} (since {time.time() - float(stage['time']):.0f} s)"
        if (self.dir / f"rank{rank}.setup.json").exists():
            return "training, before the fault's step"
        return "starting (no process group yet)"

    def _where_ranks_were(self) -> str:
        """Which ranks ended, what ended them, and where the others were."""
        ended = []
        for r in sorted(self.exit_times):
            how = how_ended(self.procs[r].returncode, _log_lines(self.dir / f"rank{r}.log"), _result(self.dir, r))
            ended.append(f"rank {r} ended ({how})")
        running = [f"rank {r} was {self._stage(r)}" for r in range(len(self.procs)) if r not in self.exit_times]
        return "; ".join(ended) + (" while " + ", ".join(running) if running else "")

    def finish(self) -> None:
        for p in self.procs:  # the process and whatever it started (its own process group)
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped process dies once it runs
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self.done = True


CPP_FRAME = re.compile(r"^(frame #\d+: |Exception raised from |terminate called )")  # a C++ traceback's lines
NCCL_TIMEOUT = "Watchdog caught collective operation timeout"  # NCCL's watchdog timed a collective out
PACK_EXIT = "exiting with code 1 so the job ends instead of hanging"  # RankWatchdog ended the process
PACK_LINE = re.compile(rf"{PACK_EXIT}|RankFailureError|CollectiveTimeoutError|^flight recorder: |^rank \d+: ")
FOREIGN = re.compile(r"^\[rank\d+\]:\[[EF]")  # an error line of torch's C++ (NCCL's watchdog)
KEY = re.compile(r"(?i)stopped responding|unreachable|timed? ?out|watchdog|abort|error")
NOISE = re.compile(r"^(nanobind: |See https://nanobind| - leaked | - \.\.\. skipped)|^\s*[\^~]+\s*$")


def _log_lines(path: Path) -> list[str]:
    """A rank's log without blank lines, caret lines and what an extension prints about leaks at exit."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip() and not NOISE.search(line)]


def _result(folder: Path, rank: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((folder / f"rank{rank}.result.json").read_text())
    return {}


def how_ended(code: Optional[int], log: list[str], result: dict[str, Any]) -> str:
    """What ended a rank process, from its exit code, its log and the result it stamped."""
    text = "\n".join(log)
    if code is None:
        return "still running"
    if result.get("outcome") == "raised":
        return f"the pack's error ({result.get('type')})" if result.get("type") in (
            "RankFailureError", "CollectiveTimeoutError") else f"an error ({result.get('type')})"
    if code == 1 and PACK_EXIT in text:
        return "the pack's watchdog (exit 1)"
    if code in (-signal.SIGABRT, 128 + signal.SIGABRT):
        return "SIGABRT from NCCL's watchdog (collective timeout)" if NCCL_TIMEOUT in text else "SIGABRT"
    if code == 0:
        return "finished"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def short_ending(ended_by: str, hung: bool) -> str:
    """``how_ended`` in a table cell."""
    if hung:
        return "hung"
    for key, label in (("the pack's watchdog", "pack exit"), ("the pack's error", "pack error"),
                       ("SIGABRT", "abort"), ("finished", "finished")):
        if ended_by.startswith(key):
            return label
    return ended_by


def pack_words_last(log: list[str]) -> bool:
    """Whether the pack's lines end the log: no C++ frame or NCCL error line after its last one."""
    last = max((i for i, line in enumerate(log) if PACK_LINE.search(line)), default=None)
    return last is not None and not any(CPP_FRAME.match(line) or FOREIGN.match(line) for line in log[last + 1:])


def _names(text: str, victim: int) -> dict[str, bool]:
    return {"rank": re.search(rf"(?i)\brank {victim}\b", text) is not None,
            "collective": COLLECTIVE.search(text) is not None, "step": STEP.search(text) is not None}


def _analyser_allows_incomplete() -> bool:
    """Whether this torch's flight recorder analyser takes ``--allow-incomplete-ranks``."""
    try:
        from torch.distributed.flight_recorder.components.config_manager import JobConfig

        with contextlib.redirect_stderr(io.StringIO()):
            JobConfig().parse_args([".", "--allow-incomplete-ranks"])
        return True
    except (Exception, SystemExit):
        return False


def _read_dump(path: Path, gpu: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"path": str(path)}
    try:
        with open(path, "rb") as f:
            dump = pickle.load(f)
    except Exception as e:
        row["read"] = False
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    entries = dump.get("entries", []) if isinstance(dump, dict) else []
    row["read"] = True
    row["entries"] = len(entries)
    row["last"] = [{k: e.get(k) for k in ("profiling_name", "state", "collective_seq_id", "process_group")}
                   for e in entries[-4:]]
    # NCCL marks completed collectives: the oldest one not completed; gloo marks none: the newest one issued
    tracked = any(e.get("state") == "completed" for e in entries)
    pending = [e for e in entries if e.get("state") != "completed"] if tracked else entries[-1:]
    row["completion_tracked"] = tracked
    row["in_flight"] = None if not pending else {k: pending[0].get(k) for k in
                                                 ("profiling_name", "state", "collective_seq_id", "process_group")}
    if gpu:  # torch's analyser reads NCCL dumps (only the survivors': incomplete ranks allowed where it can)
        folder, name = os.path.split(str(path))
        cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", folder, "--prefix",
               name.rstrip("0123456789"), "-j", *(["--allow-incomplete-ranks"] if _analyser_allows_incomplete() else [])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            row["fr_trace"] = {"command": " ".join(cmd[1:]), "returncode": done.returncode,
                               "output_tail": (done.stdout + done.stderr)[-1500:]}
        except subprocess.TimeoutExpired:
            row["fr_trace"] = {"command": " ".join(cmd[1:]), "returncode": None, "output_tail": "timed out after 60 s"}
    return row


def _check_checkpoint(sc: Scenario) -> dict[str, Any]:
    """What ``fit(ckpt_path="last")`` would resume from, loaded into a fresh module and optimizer."""
    import lightning as L
    import torch

    from lightning_perf.models import GPTConfig, GPTLightningModule
    from lightning_perf.parallel import load_checkpoint
    from lightning_perf.runtime import resume

    s = sc.spec
    folder = sc.dir / "ckpt"
    row: dict[str, Any] = {"folder": str(folder), "expected_step": s["expected_step"],
                           "files": sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []}
    try:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                                dirpath=folder, every_n_train_steps=s["every"], save_last=True)])
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            resolved = resume.resume_path(trainer, "last", repair=True, announce=True)
        row["resume_said"] = said.getvalue().strip()
        row["repaired_files"] = sorted(p.name for p in folder.iterdir())
        path = folder / "last.ckpt" if resolved == "last" else Path(resolved)
        row["resolved"] = str(resolved)
        row["path"] = path.name
        config = GPTConfig.from_name("tiny", n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"],
                                     block_size=s["seq_len"], vocab_size=s["vocab"], bias=False)
        torch.manual_seed(1)
        module = GPTLightningModule(config, learning_rate=1e-3, warmup_steps=0, min_lr_ratio=1.0)
        module.configure_model()
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
        optimizer = torch.optim.AdamW(module.parameter_groups(), lr=1e-3)
        extra = load_checkpoint(path, module, [optimizer])
        lightning = extra.get("lightning", extra) if isinstance(extra, dict) else {}
        row["step"] = lightning.get("global_step", resume.checkpoint_step(path))
        after = module.state_dict()
        row["tensors_changed"] = sum(not torch.equal(before[k], after[k]) for k in before)
        row["tensors"] = len(before)
        row["optimizer_states"] = len(optimizer.state)
        row["finite"] = all(torch.isfinite(v).all().item() for v in after.values() if v.is_floating_point())
        row["loads"] = row["tensors_changed"] > 0 and row["optimizer_states"] > 0 and row["finite"]
    except Exception as e:
        row["loads"] = False
        row["error"] = f"{type(e).__name__}: {e}"[-2000:]
    row["step_as_expected"] = row.get("step") == s["expected_step"]
    return row


def _collect(sc: Scenario) -> dict[str, Any]:
    s = sc.spec
    gpu = s["backend"] == "nccl"
    row: dict[str, Any] = {"backend": s["backend"], "devices": sc.devices or None, "victim": sc.victim,
                           "fault": sc.fault or None,
                           "timeout_s": s["timeout"], "bound_s": sc.bound(), "problem": sc.problem,
                           "victim_exit_code": sc.procs[sc.victim].returncode if sc.procs else None}
    setup = {}
    for r in range(2):
        with contextlib.suppress(OSError, ValueError):
            setup[r] = json.loads((sc.dir / f"rank{r}.setup.json").read_text())
    if setup:
        first = setup[min(setup)]
        row["env_seen_by_ranks"] = first.get("env")
        row["set_by_watchdog"] = first.get("set_by_watchdog")
        row["async_checkpoint"] = first.get("async_checkpoint")
    survivors = {}
    for r in sc.survivors:
        p = sc.procs[r] if sc.procs else None
        out: dict[str, Any] = {"exit_code": None if p is None else p.returncode, "hung": r in sc.hung}
        if sc.fault_time is not None and r in sc.exit_times:
            out["seconds_to_exit"] = round(sc.exit_times[r] - sc.fault_time, 2)
            out["within_bound"] = out["seconds_to_exit"] <= sc.bound() and not out["hung"]
        else:
            out["seconds_to_exit"] = None
            out["within_bound"] = False
        result = _result(sc.dir, r)
        if result and sc.fault_time is not None and "time" in result:
            out["seconds_to_error"] = round(result["time"] - sc.fault_time, 2)
        out["error_type"] = result.get("type")
        message = result.get("message") or ""
        out["error"] = message[-1500:] or None
        log = _log_lines(sc.dir / f"rank{r}.log")
        out["ended_by"] = "killed by the harness (hung)" if r in sc.hung else how_ended(
            None if p is None else p.returncode, log, result)
        out["nccl_timeout_logged"] = any(NCCL_TIMEOUT in line for line in log)
        out["cpp_frames_in_log"] = any(CPP_FRAME.match(line) for line in log)
        out["pack_words_last"] = pack_words_last(log)
        out["last_lines"] = [line[-600:] for line in log[-3:]]
        out["log_tail"] = [line[-600:] for line in log[-25:]]
        said_lines = [line for line in log if not line[:1].isspace() and not CPP_FRAME.match(line)]
        out["log_key_lines"] = [line[-800:] for line in said_lines if KEY.search(line)][:12]
        out["error_names"] = _names(message, sc.victim)
        # the messages of the log (not a traceback's frames, which name torch's functions)
        out["log_names"] = _names("\n".join(said_lines), sc.victim)
        said = re.search(rf"rank {sc.victim} stopped responding at step (\d+)", message + "\n".join(log))
        out["step_named_for_victim"] = int(said.group(1)) if said else None
        prefix = (setup.get(r) or {}).get("dump_prefix") or str(sc.dir / "flight_recorder" / "nccl_trace_rank_")
        dump = Path(f"{prefix}{r}")
        written = dump.is_file() and (sc.fault_time is None or dump.stat().st_mtime >= sc.started)
        out["flight_recorder"] = _read_dump(dump, gpu) if written else {"path": str(dump), "written": False}
        out["flight_recorder"]["written"] = written
        survivors[str(r)] = out
    row["survivors"] = survivors
    if sc.fault_time is not None:
        row["checkpoint"] = _check_checkpoint(sc)
    return row


def run(gpu: bool, out: str, res: dict[str, Any], names: Optional[list[str]] = None,
        save: Optional[Any] = None) -> None:
    """Every scenario (``parallel`` at a time); each one's row in ``res["rank_faults"]`` as it ends."""
    s = settings(gpu)
    part: dict[str, Any] = {"settings": s, "scenarios": {}}
    if gpu:
        part["nccl_error_handling"] = NCCL_NOTE
    res["rank_faults"] = part
    root = Path(out) / "diagnose_faults_logs" / "rank_faults"
    # on GPUs a pair runs one scenario at a time: a survivor's NCCL kernel spinning on a dead peer
    # would otherwise starve another scenario's ranks on the same GPUs (their collectives time out)
    free = gpu_pairs(_cuda_count()) if gpu else [""] * s["parallel"]
    waiting = [Scenario(n, dict(s, **SCENARIOS[n], expected_step=_expected(s, SCENARIOS[n])), root / n)
               for n in names or list(SCENARIOS)]
    active: list[Scenario] = []
    t0 = time.time()
    try:
        while waiting or active:
            while waiting and free and len(active) < s["parallel"]:
                sc = waiting.pop(0)
                sc.devices = free.pop(0)
                sc.start()
                active.append(sc)
            time.sleep(0.05)
            for sc in list(active):
                try:
                    sc.poll()
                except Exception as e:  # the parent's own bug: end this scenario, record it, go on
                    sc.problem = f"parent: {type(e).__name__}: {e}"
                    sc.finish()
                if sc.done:
                    active.remove(sc)
                    free.append(sc.devices)
                    try:
                        part["scenarios"][sc.name] = _collect(sc)
                    except Exception as e:
                        part["scenarios"][sc.name] = {"problem": f"collecting: {type(e).__name__}: {e}",
                                                      "traceback": traceback.format_exc(limit=6)}
                    part["scenarios"][sc.name]["seconds"] = round(time.time() - sc.started, 1)
                    if save is not None:
                        save()
    finally:
        for sc in waiting + active:
            if sc.procs:
                sc.finish()
    part["seconds"] = round(time.time() - t0, 1)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def _expected(s: dict[str, Any], scenario: dict[str, Any]) -> int:
    """The step of the newest checkpoint final before the fault."""
    every = s["every"]
    if scenario["where"] == "save":
        return s["save_step"] - every
    return (s["fault_step"] // every) * every


def summary_lines(part: dict[str, Any]) -> list[str]:
    rows = [("scenario", "backend", "rank", "exit", "ended by", "pack last", "NCCL timeout", "s to exit", "in bound",
             "names r/c/s", "FR dump/read", "ckpt step (expected)", "loads")]
    for name, sc in part.get("scenarios", {}).items():
        ck = sc.get("checkpoint") or {}
        ckpt = f"{ck.get('step')} ({ck.get('expected_step')})" if ck else "-"
        loads = str(ck.get("loads", "-"))
        if not sc.get("survivors"):
            rows.append((name, sc.get("backend", "?")) + ("-",) * 9 + (ckpt, loads))
        for r, sv in (sc.get("survivors") or {}).items():
            names = {k: sv["error_names"][k] or sv["log_names"][k] for k in ("rank", "collective", "step")}
            fr = sv["flight_recorder"]
            rows.append((name, sc["backend"], r, str(sv["exit_code"]),
                         short_ending(sv.get("ended_by", "?"), sv.get("hung", False)),
                         "y" if sv.get("pack_words_last") else "n", "y" if sv.get("nccl_timeout_logged") else "n",
                         str(sv["seconds_to_exit"]), f"{sv['within_bound']} (<= {sc['bound_s']:.0f})",
                         "/".join("y" if names[k] else "n" for k in ("rank", "collective", "step")),
                         f"{'y' if fr.get('written') else 'n'}/{'y' if fr.get('read') else 'n'}", ckpt, loads))
        if sc.get("problem"):
            rows.append((f"  problem: {sc['problem']}",) + ("",) * 12)
    widths = [max(len(r[i]) for r in rows if len(r) > 1 and r[1] != "") for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        if r[1] == "" and r[0].startswith("  problem"):
            lines.append(r[0])
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return lines
