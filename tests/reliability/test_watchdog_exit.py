"""A frozen rank (SIGSTOP: alive, sockets open, no heartbeat) and a dead rank 0 (the store's host), 2 gloo processes.

1. A rank blocked where no Python error comes ends itself through the watchdog before its backend's timeout, and
   the watchdog's lines end its log. That is the NCCL case: NCCL's watchdog times the collective out and later
   aborts the process from C++, with no exception in Python. Gloo raises its own errors, so the survivor here is
   given the deadline NCCL would have (the ``deadline`` callable, which ``RankWatchdog`` reads from the NCCL
   flight recorder) and blocks in a gloo collective with a long timeout (frozen peer) or in a wait that never
   returns (dead rank 0).
2. The same faults in a fit under ``ZeroStrategy`` with ``RankWatchdog``, as gloo runs them: the survivor's
   collective fails (at the timeout with a frozen peer, at once with a dead one) and it raises
   ``RankFailureError`` naming the frozen rank, or rank 0 as the unreachable store host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch
from _harness import data, launch, make_module, trainer

INTERVAL, DEAD_AFTER = 0.2, 1.0
TIMEOUT, MARGIN = 4.0, 0.5  # the collective's timeout as NCCL would apply it, and the watchdog's margin before it
COLLECTIVE = "gloo:all_reduce #2 of process group 0 (the collective in flight)"


def _watchdog(out: Path, rank: int, timeout_at: dict):
    from lightning_perf.parallel.reliability.watchdog import PeerWatchdog

    def on_exit() -> str:  # stands in for RankWatchdog's: this rank's dump, and the line naming it
        (out / f"dump{rank}").write_text("entries")
        return f"flight recorder: this rank's dump is {out / f'dump{rank}'}"

    return PeerWatchdog(interval=INTERVAL, dead_after=DEAD_AFTER, exit_after=60.0,
                        deadline=lambda: timeout_at.get("at"), deadline_margin=MARGIN,
                        describe=lambda: COLLECTIVE, on_exit=on_exit).start()


def _frozen_peer(rank: int, world: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    timeout_at: dict = {}
    watchdog = _watchdog(out, rank, timeout_at)
    watchdog.beat(5)
    time.sleep(3 * INTERVAL)  # step 5 published
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        # frozen with its sockets open; SIGKILLed later by a process of its own, so the test never waits on it
        subprocess.Popen(["sh", "-c", f"sleep 8; kill -KILL {os.getpid()}"], start_new_session=True)
        (out / "frozen_at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    timeout_at["at"] = time.time() + TIMEOUT
    (out / "blocked_at").write_text(str(timeout_at["at"] - TIMEOUT))
    dist.all_reduce(torch.ones(1))  # rank 1 never joins; gloo's own timeout (60 s) is far away
    raise AssertionError("the collective completed without rank 1")


def _dead_store_host(rank: int, world: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    timeout_at: dict = {}
    watchdog = _watchdog(out, rank, timeout_at)
    watchdog.beat(5)
    time.sleep(3 * INTERVAL)
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        (out / "killed_at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    timeout_at["at"] = time.time() + TIMEOUT
    (out / "blocked_at").write_text(str(timeout_at["at"] - TIMEOUT))
    time.sleep(60)  # as a rank whose NCCL kernel waits for a dead peer: no error, no return
    raise AssertionError("still running a minute after rank 0 died")


def _message(log: str) -> list[str]:
    """The log's last three lines: the watchdog's exit message."""
    return [line for line in log.splitlines() if line.strip()][-3:]


def _check_exit(outcome, out: Path, survivor: int) -> list[str]:
    assert outcome.exitcodes[survivor] == 1, (outcome.exitcodes, outcome.errors)
    assert outcome.errors[survivor] is None, outcome.errors[survivor]  # ended by the watchdog, not an exception
    blocked = float((out / "blocked_at").read_text())
    ended = outcome.ended[survivor] - blocked
    # margin seconds before the timeout (the parent sees the exit within its 50 ms poll)
    assert TIMEOUT - MARGIN - INTERVAL <= ended <= TIMEOUT - MARGIN + 1.0, ended
    assert (out / f"dump{survivor}").read_text() == "entries"
    lines = _message((out / f"rank{survivor}.log").read_text())
    assert lines[1].startswith(f"rank {survivor}: exiting with code 1 so the job ends instead of hanging"), lines
    assert lines[2] == f"flight recorder: this rank's dump is {out / f'dump{survivor}'}", lines
    assert f"this rank is at step 5; this rank waits in {COLLECTIVE} (its timeout, at which the backend aborts " \
           "this process, is 0." in lines[0], lines
    return lines


def test_a_frozen_peer_ends_the_survivor_before_the_collectives_timeout(tmp_path) -> None:
    out = tmp_path / "frozen"
    outcome = launch(_frozen_peer, 2, out, timeout=40)
    lines = _check_exit(outcome, out, 0)
    assert lines[0].startswith("rank 0: rank 1 stopped responding at step 5 (no heartbeat for "), lines
    assert "): it died or is frozen; " in lines[0], lines
    assert outcome.exitcodes[1] == -signal.SIGKILL  # still frozen when its own timer killed it
    log = (out / "rank0.log").read_text()
    assert "rank 0: rank 1 stopped responding at step 5" in log.split(lines[0])[0]  # said when noticed, too


def test_a_dead_store_host_ends_the_survivor_before_the_collectives_timeout(tmp_path) -> None:
    out = tmp_path / "store_host"
    outcome = launch(_dead_store_host, 2, out, timeout=40)
    lines = _check_exit(outcome, out, 1)
    assert lines[0].startswith("rank 1: the store host (rank 0) has been unreachable for "), lines
    assert "it died or was killed; " in lines[0], lines
    assert outcome.exitcodes[0] == -signal.SIGKILL


FIT_TIMEOUT = 4.0  # the strategy's collective timeout in the fits (seconds)


def _fit_with_a_fault(rank: int, world: int, out: Path, victim: int, fault: str) -> None:
    """ZeRO-2 with RankWatchdog; at step 3 the victim freezes (SIGSTOP) or is killed."""
    import lightning as L

    from lightning_perf.callbacks import RankWatchdog
    from lightning_perf.strategies import ZeroStrategy

    def on_step(module, step):
        if rank == victim and step == 3:
            (out / "fault_at").write_text(str(time.time()))
            if fault == "stop":
                subprocess.Popen(["sh", "-c", f"sleep {FIT_TIMEOUT + 6}; kill -KILL {os.getpid()}"],
                                 start_new_session=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGKILL)

    L.seed_everything(0, verbose=False)
    fit = trainer(ZeroStrategy(stage=2, timeout=FIT_TIMEOUT), world, steps=6,
                  callbacks=[RankWatchdog(interval=0.2, dead_after=DEAD_AFTER)], default_root_dir=str(out))
    fit.fit(make_module(on_step=on_step), data(4, 2, 32))
    raise AssertionError("the fit survived the fault")


def test_a_fit_names_the_frozen_rank_at_the_collectives_timeout(tmp_path) -> None:
    out = tmp_path / "fit_frozen"
    outcome = launch(_fit_with_a_fault, 2, out, 1, "stop", timeout=90)
    assert outcome.exitcodes == [1, -signal.SIGKILL], (outcome.exitcodes, outcome.errors)
    err = outcome.errors[0]
    assert err.startswith("RankFailureError"), err
    assert "rank 1 stopped responding at step " in err and "it died, was killed or is frozen" in err, err
    assert "this rank was at step 3, in " in err, err
    assert "flight recorder: each rank's last collectives are dumped to " in err, err
    elapsed = outcome.error_times[0] - float((out / "fault_at").read_text())
    assert FIT_TIMEOUT - 1 <= elapsed <= FIT_TIMEOUT + DEAD_AFTER + 2, elapsed  # gloo's timeout, then the name


def test_a_fit_names_rank_0_when_the_store_host_dies(tmp_path) -> None:
    out = tmp_path / "fit_store_host"
    outcome = launch(_fit_with_a_fault, 2, out, 0, "kill", timeout=90)
    assert outcome.exitcodes == [-signal.SIGKILL, 1], (outcome.exitcodes, outcome.errors)
    err = outcome.errors[1]
    assert err.startswith("RankFailureError"), err
    assert "rank 0 (the store host) is unreachable: it died or was killed" in err, err
    elapsed = outcome.error_times[1] - float((out / "fault_at").read_text())
    assert elapsed <= DEAD_AFTER + 3, elapsed
