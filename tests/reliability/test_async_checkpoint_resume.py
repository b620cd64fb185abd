"""Asynchronous checkpoints inside ``Trainer.fit`` (2 gloo ranks, ZeRO-2, the tiny GPT, fp32).

``ModelCheckpoint`` every 2 steps, the two newest by step plus ``last``, written in the background:

1. rank 1 is SIGKILLed inside its background write of step 4's checkpoint: nothing of step 4 goes
   live (``epoch=0-step=4.ckpt.tmp`` stays, never renamed), ``last`` and step 2's checkpoint are
   intact, and a restart with ``ckpt_path="last"`` resumes from step 2 -- the last *finalized*
   save -- on the loss curve of an uninterrupted one-process run;
2. the restarted fit returns only once its last save (step 6, held back in its finalization) is
   final, and the step-2 checkpoint that top-k drops at step 6 is removed only after that.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _harness import data, kill_self, launch, make_module, reference

TIMEOUT = 4.0
GB, SAMPLES, STEPS = 4, 32, 6


def _fit(world: int, root: Path, module, *, ckpt_path=None):
    import lightning as L

    from lightning_perf.strategies import ZeroStrategy

    strategy = ZeroStrategy(stage=2, timeout=TIMEOUT, async_checkpoint=True)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=2,
                                                      monitor="step", mode="max", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[checkpoints])
    trainer.fit(module, data(GB, 2, SAMPLES), ckpt_path=ckpt_path)
    return trainer


def _killed(rank: int, world: int, out: Path, root: Path) -> None:
    import lightning as L
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    L.seed_everything(0, verbose=False)
    if rank == 1:
        real_write, calls = FileSystemWriter.write_data, []

        def dying_write(self, *args, **kwargs):  # 3rd save: step 4's top-k checkpoint, in the background
            calls.append(1)
            if len(calls) == 3:
                kill_self()
            return real_write(self, *args, **kwargs)

        FileSystemWriter.write_data = dying_write
    _fit(world, root, make_module())
    raise AssertionError("the run survived the kill")


def _resume(rank: int, world: int, out: Path, root: Path) -> dict:
    import lightning as L

    from lightning_perf.parallel.checkpointing import checkpoint as ckpt

    d = root / "ckpt"
    left = dict(last_step=ckpt.read_extra(d / "last.ckpt")["extra"]["global_step"],
                names=sorted(p.name for p in d.iterdir()))
    real_finish = ckpt.finish_save

    def slow_finish(tmp, path, blob, **kwargs):
        if Path(path).name == "last.ckpt" and blob["extra"]["global_step"] == STEPS:
            time.sleep(1.0)  # the fit's last save: still in flight when the loop ends
        return real_finish(tmp, path, blob, **kwargs)

    ckpt.finish_save = slow_finish
    L.seed_everything(0, verbose=False)
    module = make_module()
    trainer = _fit(world, root, module, ckpt_path="last")
    after = dict(last_step=ckpt.read_extra(d / "last.ckpt")["extra"]["global_step"],
                 names=sorted(p.name for p in d.iterdir()), pending=trainer.strategy._checkpointer.pending)
    ckpt.finish_save = real_finish
    return {"left": left, "after": after, "losses": module.losses, "samples": module.samples}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async_faults")
    killed = launch(_killed, 2, root / "p1", root, timeout=90)
    resumed = launch(_resume, 2, root / "p2", root, timeout=90)
    return {"killed": killed, "resumed": resumed, "ref": reference(STEPS, GB, SAMPLES)}


def test_rank_killed_in_a_background_write_keeps_the_last_final_checkpoint(runs) -> None:
    killed = runs["killed"]
    assert killed.exitcodes[1] == -9, killed.errors  # SIGKILL
    assert killed.exitcodes[0] == 1, killed.errors
    for r in runs["resumed"].check_ok():
        assert r["left"]["last_step"] == 2
        assert r["left"]["names"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt.tmp", "last.ckpt"]


def test_resume_from_the_last_final_checkpoint_is_exact(runs) -> None:
    resumed, ref = runs["resumed"].check_ok(), runs["ref"]
    steps = list(range(2, STEPS))
    for r in resumed:
        assert sorted(r["losses"]) == steps
    mean = torch.tensor([[r["losses"][s] for s in steps] for r in resumed]).mean(0)
    torch.testing.assert_close(mean, torch.tensor([ref["losses"][s] for s in steps]), rtol=1e-5, atol=1e-6)
    ref_ids = sorted(i for s, ids in ref["samples"] if s >= 2 for i in ids)
    assert sorted(i for r in resumed for _, ids in r["samples"] for i in ids) == ref_ids


def test_fit_ends_after_its_last_save_is_final_and_removes_only_then(runs) -> None:
    for r in runs["resumed"].check_ok():
        assert r["after"]["last_step"] == STEPS
        assert r["after"]["pending"] is None
        assert r["after"]["names"] == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
