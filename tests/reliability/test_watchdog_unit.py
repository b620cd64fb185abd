"""PeerWatchdog's verdicts in one process: a HashStore stands in for the process group's
TCPStore and this test plays the peer (rank 1) by writing its heartbeat key by hand."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightning_perf.parallel.reliability.watchdog import (
    CollectiveTimeoutError,
    PeerWatchdog,
    RankFailureError,
    failed_call,
    is_timeout_error,
)

INTERVAL, DEAD_AFTER = 0.05, 0.4


def _pair(describe=None):
    store = dist.HashStore()
    wd = PeerWatchdog(store, rank=0, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER, describe=describe).start()
    wd.beat(7)
    peer_key = wd._key(1)
    return store, wd, peer_key


def _beat_for(store, key: str, seconds: float, step: int) -> None:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
        store.set(key, f"{n}:{step}")
        time.sleep(INTERVAL)


def test_alive_peer_and_a_timeout_give_the_steps() -> None:
    store, wd, key = _pair()
    _beat_for(store, key, 3 * DEAD_AFTER, step=8)
    assert wd.silent_ranks() == []
    error = wd.diagnose(RuntimeError("Timed out waiting 2000ms for recv operation to complete"))
    assert isinstance(error, CollectiveTimeoutError)
    assert error.steps == {0: 7, 1: 8}
    assert "rank 0: step 7, rank 1: step 8" in str(error)
    # a transport error with every rank alive: nothing to add (the original error stands)
    start = time.monotonic()
    assert wd.diagnose(RuntimeError("Connection reset"), wait=False) is None
    assert time.monotonic() - start < DEAD_AFTER
    wd.stop()


def test_silent_peer_is_named_with_its_last_step(caplog) -> None:
    store, wd, key = _pair(describe=lambda: "nccl:all_reduce #9 of process group 0")
    _beat_for(store, key, 2 * INTERVAL, step=5)  # then it dies
    error = wd.diagnose(RuntimeError("Connection closed by peer"))  # waits for the silence
    assert isinstance(error, RankFailureError) and error.ranks == [1]
    assert "rank 1 stopped responding at step 5" in str(error) and "this rank was at step 7" in str(error)
    time.sleep(3 * INTERVAL)
    wd.stop()
    # logged by the thread too, once (what names the rank when NCCL aborts the process itself)
    logged = [r.getMessage() for r in caplog.records if "stopped responding" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("rank 0: rank 1 stopped responding at step 5"), logged
    assert "this rank's collective: nccl:all_reduce #9 of process group 0" in logged[0], logged


def _raised_in_torch_distributed() -> BaseException:
    try:
        dist.all_reduce(torch.ones(1))  # no process group: raised inside torch.distributed.all_reduce
    except (ValueError, RuntimeError) as e:
        return e
    raise AssertionError("all_reduce without a process group did not raise")


def test_the_failed_call_is_named_from_the_traceback() -> None:
    inner = _raised_in_torch_distributed()
    line = inner.__traceback__.tb_lineno  # the all_reduce line of this file
    expected = f"torch.distributed.all_reduce (called from tests/reliability/test_watchdog_unit.py:{line})"
    assert failed_call(inner) == expected, failed_call(inner)
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = inner  # as Lightning and the strategies chain it
    assert failed_call(wrapped) == failed_call(inner)
    try:  # a torch.distributed function that is not a collective: its own name and line
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader("/nonexistent/checkpoint").read_metadata()
    except OSError as e:
        other = failed_call(e)
    assert other is not None and "torch/distributed/checkpoint/filesystem.py:" in other, other
    assert not other.startswith("torch.distributed."), other
    assert failed_call(RuntimeError("Connection closed by peer")) is None  # no traceback through torch.distributed
    # the diagnosis carries it, in the message and as an attribute
    store, wd, key = _pair()
    _beat_for(store, key, 2 * INTERVAL, step=5)
    error = wd.diagnose(wrapped)
    assert isinstance(error, RankFailureError) and error.collective == failed_call(inner)
    assert f"this rank was at step 7, in {error.collective}. Restart" in str(error), str(error)
    wd.stop()


def test_peer_that_left_the_loop_and_a_lost_store(caplog) -> None:
    store, wd, key = _pair()
    store.set(key, "done:3")
    time.sleep(3 * INTERVAL)
    error = wd.diagnose(RuntimeError("Timed out"), wait=False)
    assert isinstance(error, RankFailureError) and "rank 1 left the training loop at step 3" in str(error)
    wd.stop()

    class Broken:
        def set(self, *a):
            raise RuntimeError("connection refused")

    wd = PeerWatchdog(dist.HashStore(), rank=1, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER,
                      describe=lambda: "gloo:all_gather #4 of process group 0").start()
    wd.beat(6)
    wd._store = Broken()  # rank 0, which hosts the TCPStore, is gone
    time.sleep(3 * INTERVAL)
    logged = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("rank 1: the store host (rank 0) is unreachable"), logged
    assert logged[0].endswith("this rank is at step 6; this rank's collective: gloo:all_gather #4 of process group 0")
    error = wd.diagnose(RuntimeError("Connection closed by peer"))
    assert isinstance(error, RankFailureError) and "rank 0 (the store host) is unreachable" in str(error)
    wd.stop()


def test_timeout_detection_and_bad_arguments() -> None:
    assert is_timeout_error(RuntimeError("Timed out waiting 2000ms"))
    wrapped = RuntimeError("collective failed")
    wrapped.__cause__ = TimeoutError("deadline exceeded")
    assert is_timeout_error(wrapped)
    assert not is_timeout_error(RuntimeError("Connection closed by peer"))
    with pytest.raises(ValueError, match="interval < dead_after"):
        PeerWatchdog(dist.HashStore(), rank=0, world_size=2, interval=1.0, dead_after=0.5)
    with pytest.raises(ValueError, match="initialised default process group"):
        PeerWatchdog()


class _Exited(list):
    """Stands in for os._exit: records the code, the process goes on."""

    def __call__(self, code: int) -> None:
        self.append((code, time.monotonic()))


def _exiting(store, rank: int, exit_after: float, on_exit=None):
    wd = PeerWatchdog(store, rank=rank, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER,
                      exit_after=exit_after, on_exit=on_exit)
    wd._exit = exited = _Exited()
    return wd.start(), exited


def test_a_process_still_running_after_a_peer_died_exits_after_exit_after(caplog) -> None:
    store = dist.HashStore()
    dumped = []
    wd, exited = _exiting(store, 0, exit_after=0.3, on_exit=lambda: dumped.append(True))
    wd.beat(4)
    _beat_for(store, wd._key(1), 2 * INTERVAL, step=4)  # then rank 1 dies; this rank stays blocked
    died = time.monotonic()
    time.sleep(DEAD_AFTER + 0.3 + 6 * INTERVAL)
    assert [code for code, _ in exited] == [1] and dumped == [True]
    # silence is noticed after dead_after, the exit comes exit_after later
    assert DEAD_AFTER + 0.3 - INTERVAL <= exited[0][1] - died <= DEAD_AFTER + 0.3 + 4 * INTERVAL
    assert any("exiting with code 1" in r.getMessage() and r.getMessage().startswith("rank 0:")
               for r in caplog.records)
    wd.stop()


def test_a_lost_store_host_starts_the_exit_deadline_and_stop_cancels_it() -> None:
    class Broken:
        def set(self, *a):
            raise RuntimeError("Broken pipe")

    wd, exited = _exiting(dist.HashStore(), 1, exit_after=0.2)
    wd._store = Broken()  # rank 0, which hosts the TCPStore, is gone
    time.sleep(0.2 + 6 * INTERVAL)
    assert [code for code, _ in exited] == [1]
    wd.stop()

    # the fit ended (the error reached Python and the callback stopped the thread): no exit
    wd, exited = _exiting(dist.HashStore(), 1, exit_after=0.3)
    wd._store = Broken()
    time.sleep(2 * INTERVAL)
    wd.stop(done=False)
    time.sleep(0.3 + 4 * INTERVAL)
    assert exited == []


def test_no_exit_while_peers_live_or_without_exit_after() -> None:
    store = dist.HashStore()
    wd, exited = _exiting(store, 0, exit_after=0.0)
    _beat_for(store, wd._key(1), 3 * DEAD_AFTER, step=2)  # alive the whole time
    assert exited == []
    wd.stop()
    wd = PeerWatchdog(dist.HashStore(), rank=0, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER)
    wd._exit = exited = _Exited()
    wd.start()
    time.sleep(DEAD_AFTER + 4 * INTERVAL)  # rank 1 never beats: dead, but exit_after is None
    assert exited == []
    wd.stop()
    with pytest.raises(ValueError, match="exit_after"):
        PeerWatchdog(dist.HashStore(), rank=0, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER, exit_after=-1)


def _with_deadline(store, rank: int, deadline, *, exit_after=None, margin=0.2, on_exit=None, describe=None):
    wd = PeerWatchdog(store, rank=rank, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER, exit_after=exit_after,
                      deadline=deadline, deadline_margin=margin, on_exit=on_exit, describe=describe)
    wd._exit = exited = _Exited()
    return wd.start(), exited


def test_a_dead_peer_ends_the_process_margin_seconds_before_the_backends_timeout(caplog) -> None:
    """NCCL aborts a process at its collective's timeout (C++ frames, no Python error): the watchdog goes first."""
    store = dist.HashStore()
    timeout_at = time.time() + DEAD_AFTER + 1.0  # the collective in flight times out then
    wd, exited = _with_deadline(store, 0, lambda: timeout_at, exit_after=60.0,
                                on_exit=lambda: "flight recorder: dumped to /runs/fr/nccl_trace_rank_0",
                                describe=lambda: "nccl:_all_gather_base #154 of process group 0 (default_pg)")
    wd.beat(5)
    _beat_for(store, wd._key(1), 2 * INTERVAL, step=5)  # then rank 1 dies (or freezes)
    time.sleep(DEAD_AFTER + 1.0 + 4 * INTERVAL)
    assert [code for code, _ in exited] == [1]
    wall_at_exit = time.time() - (time.monotonic() - exited[0][1])
    assert timeout_at - 0.2 - INTERVAL <= wall_at_exit <= timeout_at - 0.2 + INTERVAL, timeout_at - wall_at_exit
    # the silence was logged when noticed, with the planned exit
    noticed = [r.getMessage() for r in caplog.records if "stopped responding" in r.getMessage()]
    assert "this process exits in 1 s unless it answers again" in noticed[0], noticed
    # then 3 lines: who stopped answering and where this rank waits, what now, where the dump is
    message = [r.getMessage() for r in caplog.records if "exiting with code 1" in r.getMessage()][-1]
    lines = message.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("rank 0: rank 1 stopped responding at step 5 (no heartbeat for "), lines[0]
    assert ("it died or is frozen; this rank is at step 5; this rank waits in nccl:_all_gather_base #154 of process "
            "group 0 (default_pg) (its timeout, at which the backend aborts this process, is 0.") in lines[0], lines[0]
    assert lines[1].startswith("rank 0: exiting with code 1 so the job ends instead of hanging; restart it")
    assert lines[2] == "flight recorder: dumped to /runs/fr/nccl_trace_rank_0"
    wd.stop()


def test_a_deadline_already_past_when_the_peer_is_found_dead_exits_at_once() -> None:
    store = dist.HashStore()
    wd, exited = _with_deadline(store, 0, lambda: time.time() - 5.0, exit_after=60.0)
    wd.beat(5)
    _beat_for(store, wd._key(1), 2 * INTERVAL, step=5)
    died = time.monotonic()
    time.sleep(DEAD_AFTER + 6 * INTERVAL)
    assert [code for code, _ in exited] == [1]
    assert DEAD_AFTER - INTERVAL <= exited[0][1] - died <= DEAD_AFTER + 4 * INTERVAL  # when the silence is noticed
    wd.stop()


def test_no_exit_before_a_deadline_while_every_peer_lives_nor_without_one() -> None:
    store = dist.HashStore()
    wd, exited = _with_deadline(store, 0, lambda: time.time() - 5.0, exit_after=60.0)  # past: a slow collective
    _beat_for(store, wd._key(1), 3 * DEAD_AFTER, step=2)  # alive the whole time: no exit on the deadline alone
    assert exited == []
    wd.stop()
    # a peer dead but nothing in flight (deadline None): exit_after decides
    store = dist.HashStore()
    wd, exited = _with_deadline(store, 0, lambda: None, exit_after=0.3)
    _beat_for(store, wd._key(1), 2 * INTERVAL, step=2)
    died = time.monotonic()
    time.sleep(DEAD_AFTER + 0.3 + 6 * INTERVAL)
    assert [code for code, _ in exited] == [1]
    assert exited[0][1] - died >= DEAD_AFTER + 0.3 - INTERVAL
    wd.stop()
    # a deadline that raises is no deadline
    store = dist.HashStore()
    wd, exited = _with_deadline(store, 0, lambda: 1 / 0, exit_after=None)
    _beat_for(store, wd._key(1), 2 * INTERVAL, step=2)
    time.sleep(DEAD_AFTER + 4 * INTERVAL)
    assert exited == []
    wd.stop()
    with pytest.raises(ValueError, match="deadline_margin"):
        PeerWatchdog(dist.HashStore(), rank=0, world_size=2, interval=INTERVAL, dead_after=DEAD_AFTER,
                     deadline_margin=-1)


def test_a_lost_store_host_exits_before_the_deadline_naming_rank_0(caplog) -> None:
    class Broken:
        def set(self, *a):
            raise RuntimeError("Broken pipe")

    timeout_at = time.time() + 1.0
    wd, exited = _with_deadline(dist.HashStore(), 1, lambda: timeout_at, exit_after=60.0,
                                describe=lambda: "nccl:_all_gather_base #154 of process group 0 (default_pg)")
    wd.beat(5)
    wd._store = Broken()  # rank 0, which hosts the TCPStore, is gone
    time.sleep(1.0 + 4 * INTERVAL)
    assert [code for code, _ in exited] == [1]
    wall_at_exit = time.time() - (time.monotonic() - exited[0][1])
    assert timeout_at - 0.2 - INTERVAL <= wall_at_exit <= timeout_at - 0.2 + INTERVAL
    message = [r.getMessage() for r in caplog.records if "exiting with code 1" in r.getMessage()][-1]
    first = message.splitlines()[0]
    assert first.startswith("rank 1: the store host (rank 0) has been unreachable for "), first
    assert "(Broken pipe): it died or was killed; this rank is at step 5; this rank waits in nccl:_all_gather_base" \
        in first, first
    wd.stop()
