"""``PreemptionCheckpoint``: a signal stops every rank at the same step, with a final checkpoint of it.

SLURM and Kubernetes send SIGTERM before they kill a job, SLURM its warning signal (SIGUSR1 by
default, ``--signal=USR1@90``) ahead of the time limit, and Ctrl-C sends SIGINT. During training
this callback's handler takes each of them and only records it: nothing runs inside the handler,
so no collective is cut in half. At the end of every optimizer step the ranks agree on whether any
of them received one, with one all-reduce of a single integer on a gloo group of their own, issued
without waiting (``async_op``) and read at the next step's end, by which time it has long completed:
no step waits for it, no host-device synchronisation. All ranks therefore stop at the same step
(one step after the signal, or the step itself on one process) and then, together:

1. write a checkpoint and wait for it to be final, also where saves are asynchronous: into the
   ``ModelCheckpoint``'s folder, as ``last`` when it has ``save_last`` (``ckpt_path="last"``
   resumes it; with ``save_last="link"`` a checkpoint of the step's own name and ``last`` pointing
   at it), else under the step's own name; without a ``ModelCheckpoint``, to
   ``<dirpath or default_root_dir/checkpoints>/preempted.ckpt``. The ranks then agree on whether
   every one of them succeeded (one all-reduce on the same gloo group). If any failed (a background
   write that ran out of device memory, say), every rank frees what it can (``gc.collect()``,
   ``torch.cuda.empty_cache()``) and writes the same checkpoint again in its own thread (the pack's
   strategies: ``foreground_checkpoints()``), and they agree again;
2. run the handler that was installed before, for SIGUSR1 (or SLURM's ``requeue_signal``), with
   saves in the foreground: Lightning's ``SLURMEnvironment(auto_requeue=True)`` saves its
   ``hpc_ckpt_<n>.ckpt`` and rank 0 calls ``scontrol requeue``, as it does in Lightning, but at a
   step boundary on every rank. Should that handler fail, rank 0 requeues the job itself; another
   handler's failure is reported and the stop goes on;
3. print one line (rank 0) naming the checkpoint (or saying that none of this step could be
   written, and why: the previous checkpoints are intact), and raise :class:`Preempted`, a
   ``SystemExit`` whose code is 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1, 130
   for SIGINT). A failed save never turns the stop into an ordinary error: the handlers, the
   requeue and the exit code are the same.

No rank waits for another longer than the strategy's collective ``timeout``: a save that fails on
one rank fails on every rank at its next collective (see ``checkpoint.agreed``), and the agreement
has the group's timeout; a rank that cannot reach the others (the agreement itself failed) skips
the second save and stops.

A second Ctrl-C raises ``KeyboardInterrupt`` at once (Lightning's way out, without a checkpoint).
Lightning's own SIGTERM handler is not called during training: it broadcasts from inside the
signal handler, wherever the rank then is, and ends the fit with ``SIGTERMException`` and no
checkpoint; the handlers it composes with it (the user's) are. Outside training (setup, the
sanity check) the handlers are Lightning's. A signal in the last step stops the fit the same way
when it ends (the checkpoint holds its final state).

``GPTLightningModule`` (through ``configure_callbacks``) and the pack's strategies add one to a
fit that has none; pass ``PreemptionCheckpoint(signals=())`` to the Trainer to turn it off.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import subprocess
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

__all__ = ["PreemptionCheckpoint", "Preempted", "attach_preemption"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
PREEMPTED_NAME = "preempted.ckpt"

_log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """Raised on every rank once a signal stopped the fit and its checkpoint is final.

    ``code`` is 128 + ``signum`` (what a shell reports for a process the signal ended); ``step`` the
    global step the checkpoint holds; ``path`` the checkpoint, or None when no checkpoint of this step
    could be written (``error`` says why; the previous checkpoints are intact).
    """

    def __init__(self, signum: int, step: int, path: Optional[str], error: Optional[str] = None) -> None:
        super().__init__(128 + int(signum))
        self.signum, self.step, self.path, self.error = int(signum), int(step), path, error


def _signum(value: Union[str, int, signal.Signals]) -> int:
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        if not hasattr(signal.Signals, name):
            raise ValueError(f"PreemptionCheckpoint: unknown signal {value!r}; e.g. SIGTERM, SIGUSR1, SIGINT")
        number = int(signal.Signals[name])
    else:
        number = int(value)
    if number in (int(signal.SIGKILL), int(signal.SIGSTOP)) or number not in {int(s) for s in signal.valid_signals()}:
        raise ValueError(f"PreemptionCheckpoint: signal {value!r} cannot be handled")
    return number


def _chained(handler: Any) -> list[Callable]:
    """The handlers of ``handler`` to run at the stop: Lightning's composed ones less its SIGTERM notifier."""
    inner = getattr(handler, "signal_handlers", None)  # Lightning's _HandlersCompose
    handlers = list(inner) if isinstance(inner, list) else [handler]
    out = []
    for h in handlers:
        if not callable(h) or h is signal.default_int_handler:
            continue  # SIG_DFL / SIG_IGN (ints), and Python's KeyboardInterrupt
        owner = getattr(h, "__self__", None)
        if type(owner).__name__ == "_SignalConnector" and getattr(h, "__name__", "") in (
                "_sigterm_notifier_fn", "_sigterm_handler_fn"):
            continue  # broadcasts, or only logs: the ranks have already agreed
        out.append(h)
    return out


class PreemptionCheckpoint(pl.Callback):
    """Stop on SIGTERM / SIGUSR1 / SIGINT at a step boundary agreed by every rank, with a final checkpoint.

    Args:
        signals: the signals to take (names or numbers); ``()`` turns the callback off. SLURM's
            ``requeue_signal`` is added when the fit runs under ``SLURMEnvironment(auto_requeue=True)``.
        dirpath: where the checkpoint goes when the fit has no ``ModelCheckpoint`` (default
            ``<default_root_dir>/checkpoints``); the file is ``preempted.ckpt``.

    After a stop, ``stopped`` is ``(signal number, global step, checkpoint path)`` (the path empty when no
    checkpoint of the step could be written).
    """

    def __init__(self, signals: Sequence[Union[str, int]] = DEFAULT_SIGNALS, dirpath: Optional[str] = None) -> None:
        if isinstance(signals, (str, int)):
            signals = (signals,)
        self.signals = tuple(dict.fromkeys(_signum(s) for s in signals))
        self.dirpath = dirpath
        self.received: Optional[int] = None  # the first signal this process got during training
        self.stopped: Optional[tuple[int, int, str]] = None
        self._previous: dict[int, Any] = {}
        self._pid: Optional[int] = None
        self._group: Optional[Any] = None
        self._blocking = False
        self._device = torch.device("cpu")
        self._work: Optional[Any] = None
        self._box: Optional[torch.Tensor] = None
        self._stepped_at: Optional[int] = None
        self._agree_error = ""  # why the last agreement on the save failed ("" : it did not)

    # ---- signals ------------------------------------------------------------------------------

    def _signals_for(self, trainer: "pl.Trainer") -> list[int]:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        out = list(self.signals)
        env = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
        requeue = getattr(env, "requeue_signal", None)
        if out and isinstance(env, SLURMEnvironment) and env.auto_requeue and requeue is not None:
            out.append(int(requeue))
        return list(dict.fromkeys(out))

    def _install(self, trainer: "pl.Trainer") -> None:
        signums = self._signals_for(trainer)
        if not signums:
            return
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("PreemptionCheckpoint: the fit does not run in the main thread, where signal handlers "
                           "are set: signals keep their current handlers")
            return
        self._pid = os.getpid()
        for signum in signums:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a process forked from this one (a DataLoader worker): the training process decides
        if self.received is not None and signum == signal.SIGINT:
            self._restore()  # a second Ctrl-C: out now, as Lightning does, without a checkpoint
            raise KeyboardInterrupt
        if self.received is None:
            self.received = int(signum)

    # ---- agreement ----------------------------------------------------------------------------

    def _start_agreement(self, trainer: "pl.Trainer") -> None:
        self._work = self._box = self._group = None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return
        timeout = getattr(trainer.strategy, "_timeout", None)
        if dist.is_gloo_available():  # a CPU collective: nothing waits for the device
            kwargs: dict[str, Any] = {"backend": "gloo"}
            if isinstance(timeout, timedelta):
                kwargs["timeout"] = timeout
            self._group, self._blocking, self._device = dist.new_group(**kwargs), False, torch.device("cpu")
        else:  # one tiny all-reduce on the training group, read at once
            self._group, self._blocking, self._device = dist.group.WORLD, True, trainer.strategy.root_device

    def _agree(self) -> int:
        """The signal some rank received (the highest number), the same on every rank; 0 when none."""
        local = int(self.received or 0)
        if self._group is None:
            return local
        if self._blocking:
            box = torch.tensor([local], dtype=torch.int32, device=self._device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._group)
            return int(box.item())
        agreed = 0
        if self._work is not None:  # issued at the previous step's end: complete by now
            self._work.wait()
            assert self._box is not None
            agreed = int(self._box.item())
            self._work = None
        if not agreed:
            self._box = torch.tensor([local], dtype=torch.int32)
            self._work = dist.all_reduce(self._box, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    # ---- hooks --------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.received, self.stopped = None, None
        self._stepped_at = trainer.global_step
        if not self.signals:
            return
        self._start_agreement(trainer)
        self._install(trainer)  # after Lightning's own (registered just before the loop starts)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.signals or trainer.global_step == self._stepped_at:
            return  # off, or no optimizer step in this batch (gradient accumulation)
        self._stepped_at = trainer.global_step
        agreed = self._agree()
        if agreed:
            self._stop(trainer, agreed)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A signal the last step's agreement carries (or, on one process, one since the last step) stops the
        fit as anywhere else: its final state is saved as the checkpoint, and the exit code is the signal's."""
        try:
            agreed = 0
            if self._work is not None:  # the last step's agreement: every rank issued it
                self._work.wait()
                assert self._box is not None
                agreed, self._work = int(self._box.item()), None
            elif self._group is None:
                agreed = int(self.received or 0)
            if agreed:
                self._stop(trainer, agreed)
        finally:
            self._restore()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._work = None
        self._restore()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._restore()

    # ---- the stop -----------------------------------------------------------------------------

    def _stop(self, trainer: "pl.Trainer", signum: int) -> None:
        step = trainer.global_step
        path, resume, error = self._final_save(trainer)
        # the handlers that were there before, at the same point on every rank: Lightning's SLURM requeue
        # (its own checkpoint, then scontrol requeue on rank 0), the user's; not Python's KeyboardInterrupt
        for handler in _chained(self._previous.get(signum)) if signum != signal.SIGINT else []:
            self._run_handler(trainer, handler, signum)
        code = 128 + signum
        if trainer.is_global_zero:
            name = signal.Signals(signum).name
            if path is not None:
                shown = f"{path} -> {os.readlink(path)}" if os.path.islink(path) else path
                print(f"lightning_perf: {name} received; stopped at global step {step} with the checkpoint {shown} "
                      f'(final); exiting with code {code}; resume with ckpt_path="{resume}"', flush=True)
            else:
                print(f"lightning_perf: {name} received; stopped at global step {step} WITHOUT a checkpoint of it: "
                      f"{error}. The previous checkpoints are intact; exiting with code {code}; resume with "
                      'ckpt_path="last" (the newest complete checkpoint)', flush=True)
        self._meet(trainer)  # no rank leaves before rank 0 has requeued and printed
        self.stopped = (signum, step, path or "")
        raise Preempted(signum, step, path, error)

    def _final_save(self, trainer: "pl.Trainer") -> tuple[Optional[str], str, Optional[str]]:
        """The checkpoint of this step, agreed final on every rank: (its path or None, what resumes it, the error)."""
        outcome = _attempt(lambda: self._save(trainer))
        agreed = self._all_succeeded(outcome[0] is not None)
        if agreed:
            return outcome[0], outcome[1], None
        error = outcome[2] or "another rank's save failed"
        if agreed is None:  # the agreement itself failed: the peers are out of reach, a second save would hang
            return None, "", f"{error}; the ranks could not agree on the save ({self._agree_error})"
        _log.warning("rank %d: the checkpoint of the stop failed (%s); freeing memory and writing it again in the "
                     "foreground", trainer.global_rank, error)
        _free_memory()
        retry = _attempt(lambda: self._save_in_foreground(trainer))
        agreed = self._all_succeeded(retry[0] is not None)
        if agreed:
            return retry[0], retry[1], None
        return None, "", (f"the background save failed ({error}), then the save in the foreground too "
                          f"({retry[2] or 'on another rank'})")

    def _save_in_foreground(self, trainer: "pl.Trainer") -> tuple[str, str]:
        with _foreground(trainer):
            return self._save(trainer, again=True)

    def _all_succeeded(self, ok: bool) -> Optional[bool]:
        """Whether every rank's save succeeded (the same answer on every rank); None: the ranks could not agree."""
        self._agree_error = ""
        if self._group is None:
            return ok
        try:
            box = torch.tensor([int(ok)], dtype=torch.int32, device=self._device)
            dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self._group)
            return bool(box.item())
        except Exception as e:  # a peer gone or past the group's timeout
            self._agree_error = f"{type(e).__name__}: {e}"
            return None

    def _meet(self, trainer: "pl.Trainer") -> None:
        """A barrier before leaving, on the agreement's gloo group where there is one (no device memory)."""
        if self._agree_error:
            return  # a peer out of reach: nothing to wait for
        try:
            if self._group is not None and not self._blocking:
                dist.barrier(group=self._group)
            else:
                trainer.strategy.barrier("preempted")
        except Exception as e:
            _log.warning("rank %d: the ranks did not meet before leaving (%s: %s)", trainer.global_rank,
                         type(e).__name__, e)

    def _run_handler(self, trainer: "pl.Trainer", handler: Callable, signum: int) -> None:
        """A previous handler, with saves in the foreground; its failure is reported, never the way out."""
        if self._agree_error and _is_lightning_requeue(handler):  # its save's collectives would wait for lost peers
            if trainer.is_global_zero:
                _requeue_slurm_job()
            return
        try:
            with _foreground(trainer):
                handler(signum, None)
                _wait_for_checkpoint(trainer)
        except BaseException as e:  # also DCP's CheckpointException, a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            _log.warning("rank %d: the signal handler %s failed: %s: %s", trainer.global_rank,
                         getattr(handler, "__qualname__", handler), type(e).__name__, e)
            if _is_lightning_requeue(handler) and trainer.is_global_zero:
                _requeue_slurm_job()  # its save failed before it requeued: the job is still requeued

    def _save(self, trainer: "pl.Trainer", again: bool = False) -> tuple[str, str]:
        """Every rank: write the checkpoint of this step and wait until it is final; (its path, what resumes it).

        ``again``: a first attempt failed, so the ``ModelCheckpoint``'s record that it saved this step is not
        trusted."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        cb = next((c for c in trainer.checkpoint_callbacks
                   if isinstance(c, ModelCheckpoint) and not c.save_weights_only and c.dirpath is not None), None)
        step = trainer.global_step
        if cb is None:
            folder = self.dirpath or os.path.join(str(trainer.default_root_dir), "checkpoints")
            path = os.path.join(str(folder), PREEMPTED_NAME)
            trainer.save_checkpoint(path)
            _wait_for_checkpoint(trainer)
            return path, path
        if not again and cb._last_global_step_saved == step and cb._last_checkpoint_saved:  # saved this step already
            path = cb.last_model_path if cb.save_last else cb._last_checkpoint_saved
        else:
            candidates = cb._monitor_candidates(trainer)
            path = ""
            if cb.save_last == "link" or not cb.save_last:  # a checkpoint of the step's own name
                path = cb._get_metric_interpolated_filepath_name(candidates, trainer)
                if cb.save_last:  # recorded in it, so that the resumed run's next last keeps the name
                    cb.last_model_path = cb.format_checkpoint_name(candidates, cb.CHECKPOINT_NAME_LAST)
                cb._save_checkpoint(trainer, path)
            if cb.save_last:
                cb._save_last_checkpoint(trainer, candidates)
                path = cb.last_model_path
        _wait_for_checkpoint(trainer)
        return str(path), "last"


def _wait_for_checkpoint(trainer: "pl.Trainer") -> None:
    """Block until the checkpoint just written is final, whatever writes it in the background."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
    if callable(wait):
        wait()
    io = getattr(trainer.strategy, "checkpoint_io", None)
    if isinstance(io, AsyncCheckpointIO):
        io.teardown()  # joins its writer thread (the fit is ending: no save follows)


def _attempt(save: Callable[[], tuple[str, str]]) -> tuple[Optional[str], str, Optional[str]]:
    """``save()`` as (path, resume, None), or (None, "", its error) if it raised."""
    try:
        path, resume = save()
        return path, resume, None
    except BaseException as e:  # also DCP's CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        return None, "", f"{type(e).__name__}: {_first_line(e)}"


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0][:800] if lines else ""


def _free_memory() -> None:
    """What a retry needs: Python's cycles collected and the device's cached, unused blocks released."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _foreground(trainer: "pl.Trainer") -> Iterator[None]:
    """Saves in the calling thread: the pack's strategies' ``foreground_checkpoints()``; under Lightning's
    ``AsyncCheckpointIO``, the plugin it wraps, for the rest of the fit (it is ending, and the async
    plugin's teardown would raise a failed save's error again, in place of the stop)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    io = getattr(trainer.strategy, "checkpoint_io", None)
    if isinstance(io, AsyncCheckpointIO) and io.checkpoint_io is not None:
        trainer.strategy.checkpoint_io = io.checkpoint_io
    foreground = getattr(trainer.strategy, "foreground_checkpoints", None)
    if not callable(foreground):
        yield
        return
    with foreground():
        yield


def _is_lightning_requeue(handler: Callable) -> bool:
    owner = getattr(handler, "__self__", None)
    return type(owner).__name__ == "_SignalConnector" and getattr(handler, "__name__", "") == "_slurm_sigusr_handler_fn"


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` of this SLURM job (an array task as ``<array job>_<task>``), as Lightning does it."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job or not re.fullmatch(r"[0-9_]+", job):
        _log.warning("no SLURM job id to requeue (SLURM_JOB_ID=%r)", job)
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job])
    except OSError as e:
        _log.warning("requeuing SLURM job %s failed: %s", job, e)
        return
    if result != 0:
        _log.warning("requeuing SLURM job %s failed with exit code %d", job, result)


def attach_preemption(trainer: "pl.Trainer") -> PreemptionCheckpoint:
    """The trainer's ``PreemptionCheckpoint``, added (with the default signals) if it has none."""
    for callback in trainer.callbacks:
        if isinstance(callback, PreemptionCheckpoint):
            return callback
    callback = PreemptionCheckpoint()
    trainer.callbacks.append(callback)
    return callback

