"""PeerWatchdog at 64 ranks: store traffic linear in the world size, and every death still named.

64 watchdogs share one ``HashStore``, each through a wrapper that counts its requests; a fake
clock and explicit rounds (``tick``, what each rank's thread does every ``interval``) make the
counts exact and the silences deterministic.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lightning_perf.parallel.reliability import watchdog as watchdog_module
from lightning_perf.parallel.reliability.watchdog import CollectiveTimeoutError, PeerWatchdog, RankFailureError

WORLD, INTERVAL, DEAD_AFTER = 64, 0.5, 2.0


class CountingStore:
    """One rank's view of the shared store: every request counted."""

    def __init__(self, store) -> None:
        self.store, self.requests = store, 0

    def set(self, key, value):
        self.requests += 1
        return self.store.set(key, value)

    def get(self, key):
        self.requests += 1
        return self.store.get(key)

    def check(self, keys):
        self.requests += 1
        return self.store.check(keys)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ranks(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(watchdog_module, "time", SimpleNamespace(monotonic=clock, sleep=lambda s: None))
    # one key namespace for all: each process of a real job counts its watchdogs from the same start
    monkeypatch.setattr(watchdog_module, "_GENERATION", itertools.repeat(7))
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(WORLD)]
    wds = [PeerWatchdog(stores[r], rank=r, world_size=WORLD, interval=INTERVAL, dead_after=DEAD_AFTER)
           for r in range(WORLD)]
    for r, wd in enumerate(wds):
        wd.beat(100 + r)
        wd.start(thread=False)

    def rounds(n: int, alive) -> None:
        for _ in range(n):
            clock.now += INTERVAL
            for r in alive:
                assert wds[r].tick()

    return SimpleNamespace(wds=wds, stores=stores, rounds=rounds)


def test_store_requests_per_interval_are_linear_in_the_world_size(ranks) -> None:
    everyone = range(WORLD)
    ranks.rounds(3, everyone)  # every key exists from here on
    before = [s.requests for s in ranks.stores]
    n = 10
    ranks.rounds(n, everyone)
    per_round = [(s.requests - b) / n for s, b in zip(ranks.stores, before)]
    total = sum(per_round)
    print(f"store requests per interval at {WORLD} ranks: {total:.0f} (rank 0: {per_round[0]:.0f}, "
          f"each other rank: {max(per_round[1:]):.0f})")
    assert max(per_round[1:]) <= 2  # its heartbeat, the verdict
    assert per_round[0] <= WORLD + 1  # every other heartbeat, the verdict and the table
    assert total <= 3 * WORLD
    # what every rank reading every peer costs: a set, then a check and a get per peer
    assert 20 * total < WORLD * (1 + 2 * (WORLD - 1))
    assert all(wd.silent_ranks() == [] for wd in ranks.wds)


def test_every_rank_names_a_dead_rank_a_departed_rank_and_a_dead_rank_0(ranks) -> None:
    wds = ranks.wds
    ranks.rounds(2, range(WORLD))
    # all alive, a collective timed out: any rank lists every rank's step (rank 0's table, two requests)
    error = wds[40].diagnose(RuntimeError("Timed out waiting 2000ms"))
    assert isinstance(error, CollectiveTimeoutError)
    assert error.steps == {r: 100 + r for r in range(WORLD)}

    rounds_to_notice = int(DEAD_AFTER / INTERVAL) + 2  # silence seen by rank 0, then one verdict later
    alive = [r for r in range(WORLD) if r != 17]
    ranks.rounds(rounds_to_notice, alive)  # rank 17 died
    for r in alive:
        assert wds[r].silent_ranks() == [17], r
    error = wds[40].diagnose(RuntimeError("Connection closed by peer"))
    assert isinstance(error, RankFailureError) and error.ranks == [17]
    assert "rank 17 stopped responding at step 117" in str(error), error

    wds[5].stop(done=True)  # rank 5 left the training loop
    alive.remove(5)
    ranks.rounds(2, alive)
    error = wds[40].diagnose(RuntimeError("Timed out"), wait=False)
    assert isinstance(error, RankFailureError) and error.ranks == [5, 17]
    assert "rank 5 left the training loop at step 105" in str(error), error

    alive.remove(0)  # rank 0 died, the store lives on (torchrun's agent hosts it)
    ranks.rounds(rounds_to_notice, alive)
    for r in alive:
        assert 0 in wds[r].silent_ranks(), r
    error = wds[63].diagnose(RuntimeError("Connection closed by peer"))
    assert isinstance(error, RankFailureError)
    assert "rank 0 stopped responding at step 100" in str(error), error


def test_rank_0_leaving_the_loop_is_named_by_the_others(ranks) -> None:
    ranks.rounds(2, range(WORLD))
    ranks.wds[0].stop(done=True)
    ranks.rounds(1, range(1, WORLD))
    error = ranks.wds[9].diagnose(RuntimeError("Timed out"), wait=False)
    assert isinstance(error, RankFailureError) and error.ranks == [0]
    assert "rank 0 left the training loop at step 100" in str(error), error
