"""Dead-rank and hang diagnosis from heartbeats kept in the process group's store.

When a rank dies (SIGKILL, OOM killer, lost node) the others fail inside their next
collective with a transport error ("Connection closed by peer", an NCCL abort) or, when
the collectives of the ranks no longer match, with a timeout after the process group's
``timeout``. Neither names the rank at fault. :class:`PeerWatchdog` runs one daemon
thread per rank that, every ``interval`` seconds, talks to the c10d store (``TCPStore``,
hosted by rank 0):

- every other rank writes its heartbeat (a counter and its current training step) and reads
  one small *verdict* key;
- rank 0, the monitor, reads every heartbeat and writes the verdict: a sequence number that
  moves at each round (rank 0's own heartbeat), its step, and the ranks it finds silent or
  gone; beside it, a table of every rank's last heartbeat, read only when diagnosing.

That is about ``3 * world_size`` store requests per interval in all (each rank polling every
peer would be ``world_size**2``). A peer whose counter has not moved for ``dead_after``
seconds is dead (or frozen); one that wrote its ``done`` marker left the training loop. The
other ranks learn it from the verdict, one interval later; a verdict that stops moving for
``dead_after`` seconds means rank 0 is dead. After a failed collective
:meth:`PeerWatchdog.diagnose` turns the exception into

- :class:`RankFailureError` naming the silent rank(s) and the step they last reported;
- :class:`CollectiveTimeoutError` when every rank is alive but a collective timed out
  (the ranks issued different collectives: one skipped or added a step), with each
  rank's step.

Both name the ``torch.distributed`` call the exception came from and its caller
(:func:`failed_call`, from the traceback), e.g. ``torch.distributed.all_gather_into_tensor``
called from FSDP's all-gather.

The thread adds no work to the training step: :meth:`beat` only stores an integer (so a
reported step is the last one published, at most ``interval`` seconds old).
A store that no longer answers means its host, rank 0, is gone. The thread also logs
(``logging``, error level) the first time a peer goes silent: under NCCL a timed-out
collective may abort the process from NCCL's own watchdog before any exception reaches
Python, and the log line is then what names the rank.

A process that is still running after the thread found a peer dead (or the store host gone) can
end itself (exit code 1), after ``on_exit`` (write the flight recorder's dump) and 2-3 logged lines
(the rank that stopped answering, the collective this rank waits in, what to do, what ``on_exit``
returned): ``exit_after`` seconds after the death was noticed, or ``deadline_margin`` seconds before
``deadline()``, whichever comes first. ``deadline`` is when the backend itself would end the process:
NCCL's watchdog times out the collective in flight at its creation plus its group's timeout, logs,
dumps, and a minute later (torch's default wait for the dumps) aborts the process from its C++
thread (SIGABRT, C++ frames as the last thing on screen, no Python exception). Ending the process
just before that timeout, once the peer is known dead, gives the same outcome in the pack's words.
A rank blocked in a collective whose own timeout never fires (NCCL's watchdog can stall on a store
whose host died with rank 0) is ended by ``exit_after`` too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

__all__ = [
    "CollectiveTimeoutError",
    "PeerState",
    "PeerWatchdog",
    "RankFailureError",
    "failed_call",
    "is_timeout_error",
]

_log = logging.getLogger(__name__)
_GENERATION = itertools.count()  # one key namespace per watchdog (same order on every rank)
_DONE = "done"
MONITOR = 0  # the rank that reads every heartbeat and publishes the verdict


class RankFailureError(RuntimeError):
    """A peer rank stopped (its heartbeat went silent): ``ranks`` lists them; ``collective``: the call that failed."""

    def __init__(self, message: str, ranks: list[int], collective: Optional[str] = None) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.collective = collective


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out while every rank was alive (mismatched collectives)."""

    def __init__(self, message: str, steps: dict[int, Optional[int]], collective: Optional[str] = None) -> None:
        super().__init__(message)
        self.steps = steps
        self.collective = collective


def is_timeout_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is a collective timeout (gloo, NCCL, store)."""
    seen = 0
    while exc is not None and seen < 8:
        text = f"{type(exc).__name__}: {exc}".lower()
        if "timed out" in text or "timeout" in text or "deadline" in text:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False


_C10D = ("distributed_c10d.py", "c10d_logger.py")  # torch.distributed's collective functions and their wrapper


def _path(frame: traceback.FrameSummary) -> str:
    return frame.filename.replace("\\", "/")


def _site(frame: traceback.FrameSummary) -> str:
    _, found, rest = _path(frame).rpartition("site-packages/")
    return f"{rest if found else '/'.join(_path(frame).split('/')[-3:])}:{frame.lineno}"


def _call_in(frames: list[traceback.FrameSummary]) -> Optional[str]:
    """The innermost ``torch.distributed`` call of one traceback (see :func:`failed_call`)."""
    inside = [i for i, f in enumerate(frames) if "/torch/distributed/" in _path(f)]
    if not inside:
        return None
    inner = inside[-1]
    if not _path(frames[inner]).endswith(_C10D):
        return f"{frames[inner].name} ({_site(frames[inner])})"
    start = inner  # the public function: the outermost of the c10d frames around the innermost one
    while start - 1 in inside and _path(frames[start - 1]).endswith(_C10D):
        start -= 1
    api = next((f for f in frames[start: inner + 1] if _path(f).endswith(_C10D[0])), frames[inner])
    caller = f" (called from {_site(frames[start - 1])})" if start > 0 else ""
    return f"torch.distributed.{api.name}{caller}"


def failed_call(exc: Optional[BaseException]) -> Optional[str]:
    """The ``torch.distributed`` call that ``exc`` (or its cause) was raised in, and where it was called from.

    The innermost frame inside ``torch/distributed/`` of the traceback: a collective of
    ``torch.distributed`` (``"torch.distributed.all_reduce (called from my/train.py:12)"``), or another
    function of the package (a ``work.wait()`` in FSDP: ``"foreach_all_gather_copy_out
    (torch/distributed/fsdp/...:321)"``). ``None`` when no frame is in ``torch.distributed``.
    """
    seen = 0
    while exc is not None and seen < 8:
        if exc.__traceback__ is not None:
            found = _call_in(traceback.extract_tb(exc.__traceback__))
            if found:
                return found
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


@dataclass(kw_only=True)
class PeerState:
    """What this rank knows of one peer."""

    rank: int
    step: Optional[int]  # last step the peer reported (None: never heard from)
    silent_s: float  # seconds since its heartbeat last changed (as seen here)
    done: bool  # it left the training loop cleanly


class PeerWatchdog:
    """Heartbeats through a c10d store; see the module docstring.

    Args:
        store: the process group's store (default: the default group's).
        rank, world_size: this rank and the number of ranks (default: the default group's).
        interval: seconds between heartbeats.
        dead_after: seconds of silence after which a peer counts as dead.
        note: appended to the line logged when a peer goes silent (where the flight recorder's
            dumps will be, for a job that NCCL aborts before Python sees an error).
        describe: called when a peer goes silent; what it returns (the collective this rank is in,
            say) is appended to the logged line. It must not raise.
        exit_after: seconds after a peer was found dead (or the store host unreachable) at which
            this process, if :meth:`stop` has not been called, logs why and exits with code 1
            (``None``: not on this count).
        deadline: called while a peer is dead; returns when (a ``time.time()``) the backend will end
            this process itself (its collective's timeout), or ``None``. It must not raise.
        deadline_margin: seconds before ``deadline()`` at which a process with a dead peer exits.
        on_exit: called just before that exit (write the flight recorder's dump, say); what it returns
            (a line: where the dump is) ends the logged message; its errors are logged and ignored.
    """

    def __init__(
        self,
        store: Optional[Any] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        interval: float = 0.5,
        dead_after: float = 5.0,
        note: str = "",
        describe: Optional[Callable[[], Optional[str]]] = None,
        exit_after: Optional[float] = None,
        deadline: Optional[Callable[[], Optional[float]]] = None,
        deadline_margin: float = 3.0,
        on_exit: Optional[Callable[[], Optional[str]]] = None,
    ) -> None:
        if interval <= 0 or dead_after <= interval:
            raise ValueError(f"need 0 < interval < dead_after, got interval={interval}, dead_after={dead_after}")
        if exit_after is not None and not exit_after >= 0:
            raise ValueError(f"exit_after must be None or >= 0 seconds, got {exit_after}")
        if not deadline_margin >= 0:
            raise ValueError(f"deadline_margin must be >= 0 seconds, got {deadline_margin}")
        if store is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("PeerWatchdog needs a store or an initialised default process group")
            store = dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.interval = float(interval)
        self.dead_after = float(dead_after)
        self.note = note
        self.describe = describe
        self.exit_after = None if exit_after is None else float(exit_after)
        self.deadline = deadline
        self.deadline_margin = float(deadline_margin)
        self.on_exit = on_exit
        self._dead_since: Optional[float] = None  # monotonic time a peer was first found dead
        self._exit = os._exit  # how the process ends (tests replace it)
        self._prefix = f"lightning_perf/watchdog/{next(_GENERATION)}/"
        self._store = store
        self._step: Optional[int] = None
        self._counter = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last value, monotonic time it changed)
        self._present: set[int] = set()  # peers whose heartbeat key exists (monitor)
        self._seq = 0  # verdicts published (monitor)
        self._verdict: dict[str, Any] = {}  # the last verdict read (other ranks)
        self._verdict_at = (-1, 0.0)  # (its sequence number, monotonic time that number changed)
        self._verdict_read_at = 0.0
        self._store_error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started_at = time.monotonic()
        self._reported: set[int] = set()

    # ---- lifecycle --------------------------------------------------------------------------

    @property
    def monitor(self) -> bool:
        """Whether this rank reads every heartbeat and publishes the verdict."""
        return self.rank == MONITOR

    def start(self, *, thread: bool = True) -> "PeerWatchdog":
        """Publish the first heartbeat (or verdict) and start the thread.

        ``thread=False``: no thread; the caller runs the rounds with :meth:`tick` (a simulation).
        """
        if self._thread is None:
            self._started_at = time.monotonic()
            self._verdict_at = (-1, self._started_at)
            if self.monitor:
                self._publish_verdict()
            else:
                self._publish()
            if thread:
                self._thread = threading.Thread(target=self._run, name="lightning_perf-watchdog", daemon=True)
                self._thread.start()
        return self

    def stop(self, *, done: bool = True) -> None:
        """Stop the thread; ``done`` tells the peers this rank left the loop on purpose."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1.0)
            self._thread = None
        if done:
            try:
                if self.monitor:
                    self._publish_verdict(done=True)
                else:
                    self._store.set(self._key(self.rank), f"{_DONE}:{self._step if self._step is not None else ''}")
            except Exception:  # the store's host may be gone already
                pass

    def beat(self, step: int) -> None:
        """Record the current step (no I/O: the thread publishes it)."""
        self._step = int(step)

    # ---- the thread -------------------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _publish(self) -> None:
        self._counter += 1
        step = "" if self._step is None else str(self._step)
        self._store.set(self._key(self.rank), f"{self._counter}:{step}")

    def _verdict_key(self) -> str:
        return f"{self._prefix}verdict"

    def _table_key(self) -> str:
        return f"{self._prefix}table"

    def _poll(self) -> None:
        """Monitor: read every peer's heartbeat (one request each once its key exists)."""
        now = time.monotonic()
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            key = self._key(peer)
            if peer not in self._present:
                if not self._store.check([key]):
                    continue
                self._present.add(peer)
            value = self._store.get(key).decode()
            with self._lock:
                last = self._seen.get(peer)
                if last is None or last[0] != value:
                    self._seen[peer] = (value, now)

    def _publish_verdict(self, *, done: bool = False) -> None:
        """Monitor: the verdict (small: only silent or gone ranks) and the table of every heartbeat."""
        self._seq += 1
        flagged = {
            str(p.rank): [p.step, round(p.silent_s, 3), p.done]
            for p in self.peers()
            if p.rank != self.rank and (p.done or p.silent_s >= self.dead_after)
        }
        verdict = {"seq": self._seq, "step": self._step, "done": done, "flagged": flagged}
        self._store.set(self._verdict_key(), json.dumps(verdict))
        with self._lock:
            table = {str(peer): value for peer, (value, _) in self._seen.items()}
        self._store.set(self._table_key(), json.dumps(table))

    def _read_verdict(self) -> None:
        """Other ranks: the monitor's verdict (one request; a check until it first exists)."""
        key = self._verdict_key()
        if not self._verdict and not self._store.check([key]):
            return
        verdict = json.loads(self._store.get(key).decode())
        now = time.monotonic()
        with self._lock:
            if verdict.get("seq") != self._verdict_at[0]:
                self._verdict_at = (verdict.get("seq"), now)
            self._verdict, self._verdict_read_at = verdict, now

    def tick(self) -> bool:
        """One round, what the thread does every ``interval``; False once the store is unreachable."""
        try:
            if self.monitor:
                self._poll()
                self._publish_verdict()
            else:
                self._publish()
                self._read_verdict()
        except Exception as e:  # the store (rank 0's TCPStore) is unreachable
            with self._lock:
                self._store_error = e
            if not self._stop.is_set():
                if self._dead_since is None:
                    self._dead_since = time.monotonic()
                _log.error("rank %d: the store host (rank 0) is unreachable: it died or was killed (%s); this rank "
                           "is at step %s%s%s", self.rank, e, self._step, self._here(), self._planned_exit())
            return False
        self._report_new_silence()
        return True

    def _run(self) -> None:
        reachable, wait = True, self.interval
        while not self._stop.wait(wait):
            if reachable and not self.tick():
                reachable = False  # the store is gone: no more rounds, only the exit deadline
            if not reachable and self._dead_since is None:
                self._dead_since = time.monotonic()
            due = self._exit_due_in()
            if due is not None and due <= 0:
                self._end_process()
                return
            wait = self.interval if due is None else min(self.interval, due)  # wake up on time for the exit

    def _deadline(self) -> Optional[float]:
        try:
            value = self.deadline() if self.deadline is not None else None
        except Exception:
            return None
        return None if value is None else float(value)

    def _exit_due_in(self) -> Optional[float]:
        """Seconds until this process ends itself (<= 0: now); ``None``: no exit planned (no peer dead, or the
        thread was stopped, or neither ``exit_after`` nor a ``deadline``)."""
        if self._dead_since is None or self._stop.is_set():
            return None
        due = []
        if self.exit_after is not None:
            due.append(self._dead_since + self.exit_after - time.monotonic())
        limit = self._deadline()
        if limit is not None:
            due.append(limit - self.deadline_margin - time.time())
        return min(due) if due else None

    def _end_process(self) -> None:
        """Run ``on_exit``, log why (2-3 lines), flush, and end the process with code 1."""
        last = None
        if self.on_exit is not None:
            try:
                last = self.on_exit()
            except Exception as e:
                last = f"rank {self.rank}: before exiting: {type(e).__name__}: {e}"
        lines = [self._exit_reason(),
                 f"rank {self.rank}: exiting with code 1 so the job ends instead of hanging; restart it "
                 "(fit(ckpt_path=\"last\") resumes from the last complete checkpoint)"]
        if last:
            lines.append(str(last))
        _log.error("%s", "\n".join(lines))
        for flushable in [*logging.getLogger().handlers, *_log.handlers, sys.stdout, sys.stderr]:
            with contextlib.suppress(Exception):  # a closed stream must not keep the process alive
                flushable.flush()
        self._exit(1)

    def _exit_reason(self) -> str:
        """The first line of the exit message: who stopped answering, and where this rank waits."""
        with self._lock:
            store_error = self._store_error
        if store_error is not None and not self.monitor:
            since = time.monotonic() - (self._dead_since or time.monotonic())
            what = (f"the store host (rank {MONITOR}) has been unreachable for {since:.1f} s "
                    f"({str(store_error).splitlines()[0] if str(store_error) else type(store_error).__name__}): "
                    "it died or was killed")
        else:
            dead = [p for p in self.peers() if p.rank != self.rank and not p.done and p.silent_s >= self.dead_after]
            what = "; ".join(
                f"rank {p.rank} stopped responding {'before its first step' if p.step is None else f'at step {p.step}'}"
                f" (no heartbeat for {p.silent_s:.1f} s): it died or is frozen" for p in dead
            ) or "a peer stopped responding"
        limit = self._deadline()
        timing = (f" (its timeout, at which the backend aborts this process, is {limit - time.time():.1f} s away)"
                  if limit is not None and limit > time.time() else "")
        here = self._here("this rank waits in")
        return f"rank {self.rank}: {what}; this rank is at step {self._step}{here}{timing}"

    def _report_new_silence(self) -> None:
        peers = self.peers()
        dead = any(p.rank != self.rank and not p.done and p.silent_s >= self.dead_after for p in peers)
        if not dead:
            self._dead_since = None  # every peer alive (again): no exit deadline
        elif self._dead_since is None:
            self._dead_since = time.monotonic()
        for p in peers:
            if p.rank == self.rank or p.rank in self._reported or not (p.done or p.silent_s >= self.dead_after):
                continue
            self._reported.add(p.rank)
            if p.done:
                _log.warning("rank %d: rank %d left the training loop at step %s", self.rank, p.rank, p.step)
            else:
                _log.error(
                    "rank %d: rank %d stopped responding at step %s (no heartbeat for %.1f s): collectives with it "
                    "will fail or time out%s%s%s",
                    self.rank, p.rank, p.step, p.silent_s, self._here(), self._planned_exit(),
                    f"; {self.note}" if self.note else "",
                )

    def _planned_exit(self) -> str:
        """When this process will end itself, as a clause of a logged line ('' when no exit is planned)."""
        due = self._exit_due_in()
        return "" if due is None else f"; this process exits in {max(due, 0.0):.0f} s unless it answers again"

    def _here(self, lead: str = "this rank's collective:") -> str:
        """What ``describe`` says, as a clause of a logged line ('' when it has nothing or fails)."""
        try:
            here = self.describe() if self.describe is not None else None
        except Exception:
            here = None
        return f"; {lead} {here}" if here else ""

    # ---- queries ----------------------------------------------------------------------------

    def peers(self) -> list[PeerState]:
        """What this rank knows of every rank: the monitor from the heartbeats, the others from the verdict."""
        if not self.monitor:
            return self._peers_from_verdict()
        now = time.monotonic()
        out = []
        with self._lock:
            for peer in range(self.world_size):
                if peer == self.rank:
                    out.append(PeerState(rank=peer, step=self._step, silent_s=0.0, done=False))
                    continue
                value, since = self._seen.get(peer, ("", self._started_at))
                head, _, step = value.partition(":")
                out.append(
                    PeerState(
                        rank=peer,
                        step=int(step) if step else None,
                        silent_s=now - since,
                        done=head == _DONE,
                    )
                )
        return out

    def _peers_from_verdict(self) -> list[PeerState]:
        now = time.monotonic()
        with self._lock:
            verdict, read_at, (_, changed_at) = self._verdict, self._verdict_read_at, self._verdict_at
        flagged = verdict.get("flagged") or {}
        out = []
        for peer in range(self.world_size):
            if peer == self.rank:
                out.append(PeerState(rank=peer, step=self._step, silent_s=0.0, done=False))
            elif peer == MONITOR:  # the verdict's sequence number is its heartbeat
                out.append(PeerState(rank=peer, step=verdict.get("step"), silent_s=now - changed_at,
                                     done=bool(verdict.get("done"))))
            elif str(peer) in flagged:
                step, silent_s, done = flagged[str(peer)]
                out.append(PeerState(rank=peer, step=step, silent_s=silent_s + (now - read_at), done=bool(done)))
            else:  # alive as of the last verdict; its step is read when diagnosing
                out.append(PeerState(rank=peer, step=None, silent_s=0.0, done=False))
        return out

    def _last_published(self, states: dict[int, PeerState]) -> None:
        """Refresh each peer's step from the store (its last heartbeat may postdate our last poll).

        The monitor reads every heartbeat; the others read the monitor's table and verdict (two requests).
        """
        try:
            if self.monitor:
                values = {}
                for peer in states:
                    key = self._key(peer)
                    if peer != self.rank and self._store.check([key]):
                        values[peer] = self._store.get(key).decode()
            else:
                values = {}
                if self._store.check([self._table_key()]):
                    values = {int(r): v for r, v in json.loads(self._store.get(self._table_key()).decode()).items()}
                if self._store.check([self._verdict_key()]):
                    verdict = json.loads(self._store.get(self._verdict_key()).decode())
                    if MONITOR in states and verdict.get("step") is not None:
                        states[MONITOR].step = verdict["step"]
                    states[MONITOR].done = states[MONITOR].done or bool(verdict.get("done"))
        except Exception:  # the store's host is gone: keep what the thread saw
            return
        for peer, value in values.items():
            if peer == self.rank or peer not in states:
                continue
            head, _, step = value.partition(":")
            states[peer].step = int(step) if step else states[peer].step
            states[peer].done = states[peer].done or head == _DONE

    def silent_ranks(self) -> list[int]:
        """Peers silent for ``dead_after`` seconds or gone (``done``); rank 0 if the store is unreachable."""
        with self._lock:
            if self._store_error is not None:
                return [0] if self.rank != 0 else []
        return [p.rank for p in self.peers() if p.rank != self.rank and (p.done or p.silent_s >= self.dead_after)]

    def diagnose(self, exc: Optional[BaseException] = None, *, wait: bool = True) -> Optional[RuntimeError]:
        """The error to raise instead of ``exc`` after a failed collective, or ``None`` if nothing is known.

        With ``wait``, gives a peer that died just now up to ``dead_after`` seconds to go
        silent (a transport error can arrive before the heartbeat is overdue). After a
        timeout there is no wait: a dead peer has been silent for the whole timeout already.
        """
        timed_out = exc is not None and is_timeout_error(exc)
        wait = wait and not timed_out
        # a death reaches the others one verdict later than the monitor
        deadline = time.monotonic() + (self.dead_after + 3 * self.interval if wait else 0.0)
        while True:
            silent = self.silent_ranks()
            if silent or time.monotonic() >= deadline or self._thread is None:
                break
            time.sleep(self.interval / 2)
        states = {p.rank: p for p in self.peers()}
        self._last_published(states)
        cause = f" ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})" if exc is not None else ""
        call = failed_call(exc)
        within = f", in {call}" if call else ""
        if silent:
            with self._lock:
                store_gone = self._store_error is not None
            parts = []
            for r in silent:
                if store_gone:
                    parts.append(f"rank {r} (the store host) is unreachable: it died or was killed")
                elif states[r].done:
                    parts.append(
                        f"rank {r} left the training loop at step {states[r].step} while this rank went on "
                        "(the ranks disagree on when training ends: a rank-local stop or early return)"
                    )
                else:
                    where = "before its first step" if states[r].step is None else f"at step {states[r].step}"
                    parts.append(
                        f"rank {r} stopped responding {where} "
                        f"(no heartbeat for {states[r].silent_s:.1f} s): it died, was killed or is frozen"
                    )
            return RankFailureError(
                f"rank {self.rank}: a collective failed because {'; '.join(parts)}; this rank was at step "
                f"{self._step}{within}. Restart the job (e.g. ckpt_path='last') to resume from the last "
                f"checkpoint{cause}",
                silent,
                call,
            )
        if timed_out:
            steps = {r: s.step for r, s in states.items()}
            listing = ", ".join(f"rank {r}: step {s}" for r, s in sorted(steps.items()))
            return CollectiveTimeoutError(
                f"rank {self.rank}: a collective timed out while every rank is alive ({listing}): the ranks "
                "issued different collectives (one skipped or added a step, or a rank-dependent branch "
                f"calls a collective){'; this rank was in ' + call if call else ''}{cause}",
                steps,
                call,
            )
        return None
