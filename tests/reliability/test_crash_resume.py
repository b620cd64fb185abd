"""Dead and diverging ranks (2 gloo processes, the tiny GPT, fp32).

1. A rank killed with SIGKILL -- inside ``dcp.save`` under ZeRO-2, at a step start under
   Parallel3D pp2 / 1F1B -- makes the other rank exit within the collective timeout with a
   ``RankFailureError`` naming the dead rank; ``last`` still points at the previous
   complete checkpoint; a restart with ``ckpt_path="last"`` continues the loss curve of
   an uninterrupted one-process run exactly and sees every remaining sample once (the
   data position is restored mid-epoch).
2. Numerics: a NaN loss on one rank only (ZeRO-3) is seen by both, which roll back to the
   last sharded checkpoint together and end where one process skipping those batches ends.
3. Hangs: a collective that one rank never joins times out after the process group's
   ``timeout`` with a ``CollectiveTimeoutError`` listing each rank's step, and a rank that
   leaves the training loop early (a rank-local ``should_stop``) is named within the
   bound instead of hanging for NCCL's default 10 minutes.

Spawning dominates the cost, so three process groups run the phases in turn; each
phase's results are saved before the next one starts. Resume equality for the other
ZeRO stages is in ``tests/strategies``.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _harness import data, kill_self, launch, make_module, reference, trainer

TIMEOUT = 4.0  # the strategies' collective timeout (seconds)
DEAD_AFTER = 1.5  # RankWatchdog's silence threshold
GB, SAMPLES, STEPS = 4, 32, 6  # global batch, samples per epoch (8 steps), steps


def _strategy(kind: str):
    from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

    if kind == "zero2":
        return ZeroStrategy(stage=2, timeout=TIMEOUT), 2  # seconds
    if kind == "dp2":  # 3D strategy, data parallel over 2 ranks: each loads its dp shard of the data
        return Parallel3DStrategy(data_parallel_size=2, zero_stage=2, timeout=timedelta(seconds=TIMEOUT)), 2
    return Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b",
                              timeout=timedelta(seconds=TIMEOUT)), 1


def _watchdog():
    from lightning_perf.callbacks import RankWatchdog

    return RankWatchdog(interval=0.25, dead_after=DEAD_AFTER)


def _stamp(out: Path, name: str) -> None:
    (out / name).write_text(str(time.time()))


def _killed(rank: int, world: int, out: Path, kind: str, root: Path) -> None:
    """Train ``kind`` with a checkpoint every 2 steps; rank 1 is killed at step 4's save / step 3."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    strategy, dp = _strategy(kind)
    on_step = None
    if kind == "zero2" and rank == 1:
        import torch.distributed.checkpoint as dcp

        real_save, calls = dcp.save, []

        def dying_save(*args, **kwargs):  # the second save (global step 4): rank 0 is writing its shard
            calls.append(1)
            if len(calls) == 2:
                _stamp(out, f"{kind}_killed_at")
                kill_self()
            return real_save(*args, **kwargs)

        dcp.save = dying_save
    elif rank == 1:
        def on_step(module, step):  # noqa: F811
            if step == 3:
                _stamp(out, f"{kind}_killed_at")
                kill_self()

    module = make_module(on_step=on_step)
    t = trainer(strategy, world, steps=STEPS, ckpt_dir=root / f"{kind}_ckpt", callbacks=[_watchdog()])
    t.fit(module, data(GB, dp, SAMPLES))
    raise AssertionError("the run survived the kill")


def _stopped(rank: int, world: int, out: Path, kind: str, root: Path) -> None:
    """A run that ends (cleanly) after step 2's checkpoint, mid-epoch."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    strategy, dp = _strategy(kind)
    trainer(strategy, world, steps=2, ckpt_dir=root / f"{kind}_ckpt").fit(make_module(), data(GB, dp, SAMPLES))


def _resume(rank: int, world: int, out: Path, kind: str, root: Path) -> None:
    import lightning as L

    from lightning_perf.parallel.checkpointing.checkpoint import read_extra

    extra = read_extra(root / f"{kind}_ckpt" / "last.ckpt")["extra"]  # what the killed run left
    (out / f"{kind}_last_step{rank}").write_text(str(extra.get("lightning", extra)["global_step"]))
    (out / f"{kind}_tmp_left").write_text(str((root / f"{kind}_ckpt" / "last.ckpt.tmp").is_dir()))
    L.seed_everything(0, verbose=False)
    strategy, dp = _strategy(kind)
    module = make_module()
    t = trainer(strategy, world, steps=STEPS, ckpt_dir=root / f"{kind}_ckpt", callbacks=[_watchdog()])
    t.fit(module, data(GB, dp, SAMPLES), ckpt_path="last")
    torch.save({"losses": module.losses, "samples": module.samples}, out / f"{kind}_resumed{rank}.pt")


def _hangs(rank: int, world: int, out: Path) -> None:
    """A collective rank 1 never joins, then a rank-local early stop (rank 1 leaves the loop)."""
    import lightning as L
    import torch.distributed as dist

    from lightning_perf.parallel.reliability.watchdog import CollectiveTimeoutError, PeerWatchdog

    watchdog = PeerWatchdog(interval=0.25, dead_after=DEAD_AFTER).start()
    watchdog.beat(10 + rank)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    if rank == 0:
        _stamp(out, "mismatch_at")
        try:
            dist.all_reduce(torch.ones(1), group=group)  # rank 1 skips it
            raise AssertionError("the collective completed without rank 1")
        except RuntimeError as e:
            error = watchdog.diagnose(e)
            _stamp(out, "mismatch_caught_at")
            assert isinstance(error, CollectiveTimeoutError), (e, error)
            (out / "mismatch.txt").write_text(str(error))
    else:
        time.sleep(2.5)  # alive (heartbeats go on), busy elsewhere
    watchdog.stop()
    dist.barrier()

    L.seed_everything(0, verbose=False)

    def leave(module, step):
        if rank == 1 and step == 2:
            _stamp(out, "left_at")
            module.trainer.should_stop = True  # rank-local: the other rank goes on to step 3

    strategy, dp = _strategy("zero2")
    t = trainer(strategy, world, steps=STEPS, callbacks=[_watchdog()])
    t.fit(make_module(on_step=leave), data(GB, dp, SAMPLES))
    if rank == 1:  # stay alive (sockets open) until rank 0 has given up
        deadline = time.time() + 3 * TIMEOUT
        while not (out / "rank0.err").exists() and time.time() < deadline:
            time.sleep(0.1)


def _rollback(rank: int, world: int, out: Path, root: Path) -> None:
    """ZeRO-3, NaN loss on rank 1 only at step 3: both ranks agree and roll back to step 2's checkpoint."""
    import lightning as L

    from lightning_perf.callbacks import NonFiniteGuard
    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict
    from lightning_perf.strategies import ZeroStrategy

    L.seed_everything(0, verbose=False)
    guard = NonFiniteGuard("rollback")
    module = make_module(nan_at={3} if rank == 1 else set())
    t = trainer(ZeroStrategy(stage=3, timeout=TIMEOUT), world, steps=-1, max_epochs=1,
                ckpt_dir=root / "rollback_ckpt", callbacks=[guard, _watchdog()])
    t.fit(module, data(GB, 2, SAMPLES))
    final = full_model_state_dict(module)
    torch.save({"final": final, "bad_steps": guard.bad_steps, "rollbacks": guard.rollbacks}, out / f"rollback{rank}.pt")


def _all_phases(rank: int, world: int, out: Path, phase: int, root: Path) -> None:
    if phase == 1:
        _rollback(rank, world, out, root)
        _killed(rank, world, out, "zero2", root)
    elif phase == 2:
        _resume(rank, world, out, "zero2", root)
        _killed(rank, world, out, "pp2", root)
    else:
        _resume(rank, world, out, "pp2", root)
        _stopped(rank, world, out, "dp2", root)
        _resume(rank, world, out, "dp2", root)
        _hangs(rank, world, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("faults")  # checkpoints live here across the phases
    res = {phase: launch(_all_phases, 2, root / f"p{phase}", phase, root, timeout=120) for phase in (1, 2, 3)}
    res["root"] = root
    res["ref"] = reference(STEPS, GB, SAMPLES)
    return res


def test_nan_on_one_rank_rolls_back_every_rank(runs) -> None:
    """Same final weights as one process that skipped batch 2 (undone by the rollback) and 3 (NaN)."""
    import lightning as L

    from _harness import make_module as make

    out = runs["root"] / "p1"
    got = [torch.load(out / f"rollback{r}.pt", weights_only=False) for r in range(2)]
    for g in got:
        assert g["bad_steps"] == [3]
        assert len(g["rollbacks"]) == 1 and g["rollbacks"][0][0] == 3
    L.seed_everything(0, verbose=False)
    ref = make(skip_batches={2, 3})
    trainer("auto", 1, steps=-1, max_epochs=1).fit(ref, data(GB, 1, SAMPLES))
    expected = ref.state_dict()
    # Adam moves each weight by ~lr = 3e-3 per step: a step too many or too few is 30x the tolerance,
    # which only absorbs the 2-rank reduction's rounding, amplified by Adam on near-zero moments
    for g in got:
        assert g["final"].keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(g["final"][k], expected[k], rtol=1e-3, atol=1e-4, msg=lambda m: f"{k}: {m}")
    L.seed_everything(0, verbose=False)
    no_rollback = make(skip_batches={3})  # had batch 2's update been kept
    trainer("auto", 1, steps=-1, max_epochs=1).fit(no_rollback, data(GB, 1, SAMPLES))
    gap = max((got[0]["final"][k] - v).abs().max().item() for k, v in no_rollback.state_dict().items())
    assert gap > 1e-3, gap


def _check_killed(outcome, out: Path, kind: str, resumed: Path) -> None:
    assert outcome.exitcodes[1] == -9, outcome.errors  # SIGKILL
    assert outcome.exitcodes[0] == 1, outcome.errors
    err = outcome.errors[0]
    assert err.startswith("RankFailureError"), err
    assert "rank 1 stopped responding" in err, err
    # and the torch.distributed call this rank failed in: a collective with its caller, or a wait in torch's code
    assert re.search(r"this rank was at step \d+, in (torch\.distributed\.\w+ \(called from |\w+ \(torch/distributed/)",
                     err), err
    # noticed within the collective timeout (+ the watchdog's wait for the heartbeat to go silent)
    elapsed = outcome.error_times[0] - float((out / f"{kind}_killed_at").read_text())
    assert 0 <= elapsed < TIMEOUT + DEAD_AFTER + 2, elapsed
    for r in range(2):  # "last" pointed at the last complete save when the restart began
        assert (resumed / f"{kind}_last_step{r}").read_text() == "2"


def _check_resumed(out: Path, kind: str, ref: dict) -> None:
    resumed = [torch.load(out / f"{kind}_resumed{r}.pt", weights_only=False) for r in range(2)]
    steps = list(range(2, STEPS))
    for r in resumed:
        assert sorted(r["losses"]) == steps
    # data-parallel ranks see half the batch each (the mean is the global batch's loss); pp ranks the whole
    mean = torch.tensor([[r["losses"][s] for s in steps] for r in resumed]).mean(0)
    torch.testing.assert_close(mean, torch.tensor([ref["losses"][s] for s in steps]), rtol=1e-5, atol=1e-6)
    # every sample of steps 2.. exactly once, the same ones as uninterrupted (no repeat, no skip)
    ref_ids = sorted(i for s, ids in ref["samples"] if s >= 2 for i in ids)
    ranks = resumed if kind in ("zero2", "dp2") else resumed[:1]
    assert sorted(i for r in ranks for _, ids in r["samples"] for i in ids) == ref_ids


def test_zero2_rank_killed_mid_save(runs) -> None:
    root = runs["root"]
    _check_killed(runs[1], root / "p1", "zero2", root / "p2")
    assert (root / "p2" / "zero2_tmp_left").read_text() == "True"  # the cut-short save never went live


def test_zero2_resumes_from_last_exactly(runs) -> None:
    _check_resumed(runs["root"] / "p2", "zero2", runs["ref"])


def test_pp2_rank_killed_at_a_step(runs) -> None:
    root = runs["root"]
    _check_killed(runs[2], root / "p2", "pp2", root / "p3")


def test_pp2_resumes_from_last_exactly(runs) -> None:
    _check_resumed(runs["root"] / "p3", "pp2", runs["ref"])


def test_3d_data_parallel_resumes_mid_epoch_exactly(runs) -> None:
    """Parallel3D's dp ranks shard the data through TokenDataModule's resumable loader (a plain
    DataLoader restarts the epoch on resume: Lightning restores only loaders with a state_dict)."""
    assert (runs["root"] / "p3" / "dp2_last_step0").read_text() == "2"
    _check_resumed(runs["root"] / "p3", "dp2", runs["ref"])


def test_collective_mismatch_times_out_with_each_ranks_step(runs) -> None:
    out = runs["root"] / "p3"
    text = (out / "mismatch.txt").read_text()
    assert "timed out while every rank is alive (rank 0: step 10, rank 1: step 11)" in text, text
    assert "this rank was in torch.distributed.all_reduce (called from tests/reliability/test_crash_resume.py:" in text
    waited = float((out / "mismatch_caught_at").read_text()) - float((out / "mismatch_at").read_text())
    assert 1.5 < waited < 2 + 3, waited  # the group's 2 s timeout, not minutes


def test_rank_leaving_the_loop_is_named_within_the_timeout(runs) -> None:
    outcome, out = runs[3], runs["root"] / "p3"
    assert outcome.exitcodes[1] == 0, outcome.errors
    assert outcome.exitcodes[0] == 1, outcome.errors
    err = outcome.errors[0]
    assert err.startswith(("RankFailureError", "CollectiveTimeoutError")), err
    assert "rank 1 left the training loop at step 2" in err, err
    elapsed = outcome.error_times[0] - float((out / "left_at").read_text())
    assert elapsed < TIMEOUT + DEAD_AFTER + 3, elapsed
