"""A rank killed with SIGKILL (in a training step, or in the middle of a checkpoint write):
every other rank exits within the collective timeout with an error naming the dead rank,
``last`` still points at the previous complete checkpoint, and a restart with
``ckpt_path="last"`` continues the loss curve of an uninterrupted run exactly (fp32, CPU),
seeing every sample once (the data position is restored mid-epoch).

ZeRO-2 (killed inside ``dcp.save``) and Parallel3D pp2 / 1F1B (killed at a step start).
Resume equality for the other ZeRO stages is covered in ``tests/strategies``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from _harness import data, kill_self, launch, make_module, reference, trainer

TIMEOUT = 6.0  # the strategies' collective timeout (seconds)
DEAD_AFTER = 2.0  # RankWatchdog's silence threshold
GB, SAMPLES, STEPS = 4, 32, 6  # global batch, samples per epoch (8 steps), steps


def _strategy(kind: str):
    from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

    if kind == "zero2":
        return ZeroStrategy(stage=2, timeout=timedelta(seconds=TIMEOUT)), 2
    return Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b",
                              timeout=timedelta(seconds=TIMEOUT)), 1


def _watchdog():
    from lightning_perf.callbacks import RankWatchdog

    return RankWatchdog(interval=0.25, dead_after=DEAD_AFTER)


def _killed_run(rank: int, world: int, out: Path, kind: str) -> dict:
    import lightning as L

    L.seed_everything(0, verbose=False)
    strategy, dp = _strategy(kind)
    on_step = None
    if kind == "zero2" and rank == 1:
        # die inside the second checkpoint write (global step 4): rank 0 is writing its shard
        import torch.distributed.checkpoint as dcp

        real_save, calls = dcp.save, []

        def dying_save(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                (out / "killed_at").write_text(str(time.time()))
                kill_self()
            return real_save(*args, **kwargs)

        dcp.save = dying_save
    elif rank == 1:
        def on_step(module, step):  # noqa: F811
            if step == 3:
                (out / "killed_at").write_text(str(time.time()))
                kill_self()

    module = make_module(on_step=on_step)
    t = trainer(strategy, world, steps=STEPS, ckpt_dir=out / "ckpt", callbacks=[_watchdog()])
    t.fit(module, data(GB, dp, SAMPLES))
    return {"losses": module.losses}


def _resumed_run(rank: int, world: int, out: Path, kind: str) -> dict:
    import lightning as L

    L.seed_everything(0, verbose=False)
    strategy, dp = _strategy(kind)
    module = make_module()
    t = trainer(strategy, world, steps=STEPS, ckpt_dir=out.parent / "ckpt", callbacks=[_watchdog()])
    t.fit(module, data(GB, dp, SAMPLES), ckpt_path="last")
    return {"losses": module.losses, "samples": module.samples}


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference(STEPS, GB, SAMPLES)


@pytest.mark.parametrize("kind", ["zero2", "parallel3d_pp2"])
def test_killed_rank_is_named_and_last_resumes_exactly(kind: str, ref: dict, tmp_path: Path) -> None:
    from lightning_perf.parallel.checkpoint import read_extra

    killed = launch(_killed_run, 2, tmp_path, kind, timeout=90)
    assert killed.exitcodes[1] == -9, killed.errors  # SIGKILL
    assert killed.exitcodes[0] == 1, killed.errors
    err = killed.errors[0]
    assert err.startswith("RankFailureError"), err
    assert "rank 1 stopped responding" in err, err
    # noticed within the collective timeout (+ the watchdog's wait for the heartbeat to go silent)
    elapsed = killed.error_times[0] - float((tmp_path / "killed_at").read_text())
    assert 0 <= elapsed < TIMEOUT + DEAD_AFTER + 2, elapsed

    last = tmp_path / "ckpt" / "last.ckpt"
    extra = read_extra(last)["extra"]
    assert extra.get("lightning", extra)["global_step"] == 2  # the last complete save
    if kind == "zero2":  # the save that was cut short left only its temporary directory
        assert (tmp_path / "ckpt" / "last.ckpt.tmp").is_dir()

    resumed = launch(_resumed_run, 2, tmp_path / "resume", kind, timeout=90).check_ok()
    steps = list(range(2, STEPS))
    for r in resumed:
        assert sorted(r["losses"]) == steps
    # ZeRO ranks see half the batch each (the mean is the global batch's loss); pp ranks see the whole
    mean = torch.tensor([[r["losses"][s] for s in steps] for r in resumed]).mean(0)
    torch.testing.assert_close(mean, torch.tensor([ref["losses"][s] for s in steps]), rtol=1e-5, atol=1e-6)
    # every sample of steps 2.. exactly once, the same ones as uninterrupted (no repeat, no skip)
    ref_ids = sorted(i for s, ids in ref["samples"] if s >= 2 for i in ids)
    if kind == "zero2":
        got = sorted(i for r in resumed for _, ids in r["samples"] for i in ids)
    else:
        got = sorted(i for _, ids in resumed[0]["samples"] for i in ids)
    assert got == ref_ids
