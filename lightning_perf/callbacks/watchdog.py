"""``RankWatchdog``: name the dead rank (or the mismatched steps) when a collective fails, and where
the flight recorder's dumps of every rank's last collectives are.

A thin adapter over :class:`lightning_perf.parallel.reliability.watchdog.PeerWatchdog`: heartbeats
start in ``setup`` once the process group exists, each training batch records its step
(an integer store, no I/O), and ``on_exception`` replaces a failed collective's transport
error or timeout by a :class:`RankFailureError` / :class:`CollectiveTimeoutError` that
names the rank at fault and the collective call it failed in (and, where torch's flight recorder
records, the collective in flight by its sequence number and process group). How fast a rank notices is bounded by the strategy's
``timeout`` (``ZeroStrategy(timeout=...)``, ``Parallel3DStrategy(timeout=...)``), which
both gloo and NCCL honour; a killed peer is usually noticed at once (its sockets close).

Under NCCL a collective with a dead or frozen peer raises nothing in Python: NCCL's own watchdog
times it out, and about a minute later aborts the process from C++ (SIGABRT). So once a peer has
been silent for ``dead_after``, a rank still inside the fit ends itself first: a few seconds before
the timeout of the collective it waits in (read from its flight recorder: when the collective was
created, and its group's timeout), after writing its flight-recorder dump and logging 2-3 lines
(the rank that stopped answering, the collective, where the dumps are), or ``exit_after`` seconds
after the death was noticed if that comes first.

The flight recorder (:mod:`lightning_perf.parallel.reliability.flight_recorder`) is configured in
``prepare_process_group``, which the pack's strategies call just before they create the process
group: under NCCL it sets the variables the user has not set (a buffer of ``buffer_size``
collectives, a dump on timeout, dumps at ``<dump_dir>/nccl_trace_rank_<rank>``). Under another
strategy the group exists before any callback hook runs, so ``setup`` sets them then: the dump path
still takes effect (torch reads it when it first dumps), the buffer and dump-on-timeout stay at
torch's defaults (on in torch 2.11 and 2.13).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_perf.parallel.reliability.flight_recorder import (
    DUMP_NAME,
    FLIGHT_RECORDER_VARS,
    collective_deadline,
    collective_in_flight,
    dump_files,
    dump_flight_recorder,
    enable_flight_recorder,
    read_command,
)
from lightning_perf.parallel.reliability.watchdog import (
    CollectiveTimeoutError,
    PeerWatchdog,
    RankFailureError,
    is_timeout_error,
)

__all__ = ["RankWatchdog", "RankFailureError", "CollectiveTimeoutError"]

_log = logging.getLogger(__name__)


class RankWatchdog(pl.Callback):
    """Heartbeats between ranks; a failed collective is reported with the dead rank's number and the
    flight recorder's dump files.

    Args:
        interval: seconds between heartbeats.
        dead_after: seconds of silence after which a rank counts as dead; keep it below
            the strategy's collective ``timeout``.
        flight_recorder: configure torch's flight recorder under NCCL, and on a failed collective
            write this rank's buffer and name every rank's dump in the error.
        dump_dir: where the dumps go (default ``<default_root_dir>/flight_recorder``); a dump path the
            user set (``TORCH_FR_DUMP_TEMP_FILE``) wins.
        buffer_size: collectives kept per rank.
        exit_after: seconds after a rank was found dead (or rank 0's store unreachable) at which a
            process still in the fit writes its flight-recorder dump and exits with code 1, so a rank
            blocked in a collective whose own timeout never fires does not hang the job (NCCL's
            watchdog can stall on the store of a dead rank 0). ``"timeout"`` (default): the
            strategy's collective ``timeout`` (torch's default where the strategy has none). Under
            NCCL with the flight recorder on, the exit comes earlier if the collective this rank waits
            in would time out sooner: ``deadline_margin`` seconds before that timeout. ``None``: never.
        deadline_margin: seconds before NCCL's timeout of the collective in flight at which a rank
            with a dead peer ends itself (time to write its dump and log why).
    """

    def __init__(self, interval: float = 0.5, dead_after: float = 5.0, *, flight_recorder: bool = True,
                 dump_dir: Optional[str] = None, buffer_size: int = 2000,
                 exit_after: Union[float, Literal["timeout"], None] = "timeout",
                 deadline_margin: float = 3.0) -> None:
        if interval <= 0 or dead_after <= interval:
            raise ValueError(f"need 0 < interval < dead_after, got interval={interval}, dead_after={dead_after}")
        if exit_after is not None and exit_after != "timeout" and (
                isinstance(exit_after, bool) or not isinstance(exit_after, (int, float)) or not exit_after >= 0):
            raise ValueError(f"exit_after must be 'timeout', None or seconds >= 0, got {exit_after!r}")
        self.exit_after = exit_after
        if isinstance(deadline_margin, bool) or not isinstance(deadline_margin, (int, float)) or \
                not deadline_margin >= 0:
            raise ValueError(f"deadline_margin must be seconds >= 0, got {deadline_margin!r}")
        self.deadline_margin = float(deadline_margin)
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.interval = interval
        self.dead_after = dead_after
        self.flight_recorder = flight_recorder
        self.dump_dir = dump_dir
        self.buffer_size = buffer_size
        self.watchdog: Optional[PeerWatchdog] = None
        self.dump_prefix: Optional[str] = None
        self.flight_recorder_env: dict[str, str] = {}  # what this callback set
        self.set_before_process_group = False
        self._backend: Optional[str] = None
        self._group_timeout_s: Optional[float] = None
        self._started = time.time()

    # ---- flight recorder ----------------------------------------------------------------------

    def _prefix(self, trainer: "pl.Trainer") -> str:
        names = FLIGHT_RECORDER_VARS["dump_prefix"]
        user = next((os.environ[n] for n in names if os.environ.get(n)), None)
        if user is not None:
            return user
        root = self.dump_dir or os.path.join(str(getattr(trainer, "default_root_dir", None) or os.getcwd()),
                                             "flight_recorder")
        return os.path.join(root, DUMP_NAME)

    def prepare_process_group(self, trainer: "pl.Trainer", backend: str) -> None:
        """Set the flight recorder's variables for ``backend``; call it before the process group exists."""
        self._backend = backend
        self._started = time.time()
        if not self.flight_recorder:
            return
        self.dump_prefix = self._prefix(trainer)
        if backend == "nccl":
            os.makedirs(os.path.dirname(self.dump_prefix) or ".", exist_ok=True)
            self.flight_recorder_env.update(enable_flight_recorder(self.dump_prefix, buffer_size=self.buffer_size))
        self.set_before_process_group = not (dist.is_available() and dist.is_initialized())

    def describe_dumps(self) -> str:
        """Where every rank's dump is (or will be) and how to read them."""
        if self.dump_prefix is None:
            return ""
        written = dump_files(self.dump_prefix, newer_than=self._started - 1.0)
        have = f" (written: {', '.join(written)})" if written else " (none written yet)"
        return (f"flight recorder: each rank's last collectives are dumped to {self.dump_prefix}<rank>{have}; "
                f"read them with {read_command(self.dump_prefix)}")

    def _in_flight(self) -> Optional[str]:
        """The collective this rank's flight recorder shows it in (None: off, or nothing recorded)."""
        if not self.flight_recorder or self._backend is None:
            return None
        return collective_in_flight(nccl=self._backend == "nccl")

    def _nccl_deadline(self) -> Optional[float]:
        """When NCCL's watchdog times out the collective this rank waits in (None: not NCCL, no recorder)."""
        if not self.flight_recorder or self._backend != "nccl":
            return None
        return collective_deadline(default_timeout_s=self._group_timeout_s)

    @staticmethod
    def _strategy_timeout(trainer: "pl.Trainer") -> float:
        """The strategy's collective timeout in seconds (torch's default where the strategy has none)."""
        timeout = getattr(getattr(trainer, "strategy", None), "_timeout", None)
        if timeout is None:
            timeout = default_pg_timeout
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)

    def _exit_seconds(self, trainer: "pl.Trainer") -> Optional[float]:
        """``exit_after`` in seconds: the strategy's collective timeout for ``"timeout"``."""
        if self.exit_after != "timeout":
            return None if self.exit_after is None else float(self.exit_after)
        return self._strategy_timeout(trainer)

    def _before_exit(self, trainer: "pl.Trainer") -> str:
        """The watchdog's last act before it ends the process: this rank's dump, and the line naming the dumps."""
        self._dump_this_rank(trainer)
        return self.describe_dumps()

    def _dump_this_rank(self, trainer: "pl.Trainer") -> None:
        """This rank's buffer, unless torch's watchdog wrote it during this fit."""
        if self.dump_prefix is None:
            return
        rank = int(getattr(trainer, "global_rank", 0))
        path = f"{self.dump_prefix}{rank}"
        if os.path.exists(path) and os.path.getmtime(path) >= self._started - 1.0:
            return
        try:
            dump_flight_recorder(self.dump_prefix, rank, nccl=self._backend == "nccl")
        except (RuntimeError, OSError) as err:
            _log.warning("rank %d: could not write the flight recorder dump %s: %s", rank, path, err)

    # ---- hooks ----------------------------------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and self._backend is None:  # a strategy that did not call prepare_process_group
            self.prepare_process_group(trainer, dist.get_backend())
        if self.dump_prefix is not None and self._backend == "nccl":
            rank_zero_info(f"RankWatchdog: {self.describe_dumps()}")
        if self.watchdog is None and distributed and dist.get_world_size() > 1:
            note = f"flight recorder dumps at {self.dump_prefix}<rank>" if self.dump_prefix else ""
            exit_after = self._exit_seconds(trainer)
            self._group_timeout_s = self._strategy_timeout(trainer)  # for a recorder entry without its own
            self.watchdog = PeerWatchdog(interval=self.interval, dead_after=self.dead_after, note=note,
                                         describe=self._in_flight, exit_after=exit_after,
                                         deadline=None if self.exit_after is None else self._nccl_deadline,
                                         deadline_margin=self.deadline_margin,
                                         on_exit=lambda: self._before_exit(trainer)).start()
            self.watchdog.beat(trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(trainer.global_step)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.watchdog is not None:
            self.watchdog.stop(done=True)
            self.watchdog = None
        self._backend = None

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        watchdog, self.watchdog = self.watchdog, None
        if isinstance(exception, SystemExit):  # a requested stop (PreemptionCheckpoint), not a fault
            if watchdog is not None:
                watchdog.stop(done=True)
            return
        if isinstance(exception, (RankFailureError, CollectiveTimeoutError, KeyboardInterrupt)):
            return
        error = watchdog.diagnose(exception) if watchdog is not None else None
        if watchdog is not None:
            watchdog.stop(done=False)
        if error is None and not is_timeout_error(exception):
            return
        in_flight = self._in_flight()
        self._dump_this_rank(trainer)
        dumps = self.describe_dumps()
        if error is None:
            if dumps:
                _log.error("rank %d: a collective timed out; %s", int(getattr(trainer, "global_rank", 0)), dumps)
            return
        if in_flight:
            error.args = (f"{error}. This rank's collective: {in_flight}",)
        if dumps:
            error.args = (f"{error}. {dumps}",)
        raise error from exception
