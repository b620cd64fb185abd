"""A crash at any point of the pack's save sequence: the next ``fit(ckpt_path="last")`` resumes at the right step.

One process (``ZeroStrategy`` on one rank, the tiny GPT), ``ModelCheckpoint`` every 2 steps keeping the
newest checkpoint by step plus ``last``, 6 steps. The process is SIGKILLed at one point of the step-4
save, found by wrapping the function that does it:

=====================  =====================================================  =================
crash point            state left                                             resumes at
=====================  =====================================================  =================
tmp_write              step 4's shards half written (``.tmp``, no extra.pt)    2 (``last``)
between_renames        ``last.ckpt.old`` (step 2) + complete ``last.ckpt.tmp``  4 (recovered)
old_removal            ``last.ckpt`` (step 4) + half-deleted ``last.ckpt.old``  4
delete_older           step 2's top-k copy half deleted (``.del``)              4 (newer than last)
async_finalize         step 4's background finalize, before ``extra.pt``        2
async_renames          the background rename of ``last.ckpt``, between the two  4 (recovered)
link_creation          ``save_last="link"``: the new link made, not yet renamed 4 (newer than last)
link_delete_older      ``"link"``: step 2 half deleted after the link moved      4
link_async_finalize    ``"link"``, background: step 4 never final               2 (link not moved)
=====================  =====================================================  =================

(``last`` is saved after the step's top-k checkpoint: a crash between the two leaves a complete
checkpoint newer than ``last``, which the resume takes.) Each resumed run trains the remaining steps
on the loss curve of one process never stopped, and leaves a clean folder. Then the states a crash
of another writer leaves: a ``last`` link that dangles beside complete checkpoints resumes from the
newest of them (one printed line); a folder holding only a partial save refuses, saying why.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from _harness import data, kill_self, launch, make_module, reference

GB, SAMPLES, STEPS = 4, 32, 6

S2, S4, LAST = "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"
# scenario -> (save_last, async saves, the step the resumed run starts from, the folder the crash left)
SCENARIOS = {
    "tmp_write": (True, False, 2, [S2, S4 + ".tmp", LAST]),
    "between_renames": (True, False, 4, [S4, LAST + ".old", LAST + ".tmp"]),
    "old_removal": (True, False, 4, [S4, LAST, LAST + ".old"]),
    "delete_older": (True, False, 4, [S2 + ".del", S4, LAST]),
    "async_finalize": (True, True, 2, [S2, S4 + ".tmp", LAST]),
    "async_renames": (True, True, 4, [S4, LAST + ".old", LAST + ".tmp"]),
    "link_creation": ("link", False, 4, [S2, S4, LAST, LAST + ".linktmp"]),
    "link_delete_older": ("link", False, 4, [S2 + ".del", S4, LAST]),
    "link_async_finalize": ("link", True, 2, [S2, S4 + ".tmp", LAST]),
}


def _trainer(root: Path, save_last, async_save: bool, steps: int = STEPS):
    import lightning as L

    from lightning_perf.strategies import ZeroStrategy

    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=1,
                                                      monitor="step", mode="max", save_last=save_last)
    return L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2, async_checkpoint=async_save),
                     max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0, callbacks=[checkpoints])


def _inject(scenario: str) -> None:
    """Wrap the step of the save sequence that ``scenario`` names so that the process dies there."""
    import torch.distributed.checkpoint.filesystem as fs

    from lightning_perf.parallel.checkpointing import checkpoint as ckpt

    real_replace, real_rmtree, real_write, real_finish = os.replace, shutil.rmtree, fs.FileSystemWriter.write_data, \
        ckpt.finish_save
    writes: list[int] = []
    links: list[int] = []

    def name(p) -> str:
        return Path(p).name

    def replace(src, dst, *a, **k):
        if scenario in ("between_renames", "async_renames") and name(src) == "last.ckpt" and name(dst).endswith(".old"):
            real_replace(src, dst, *a, **k)
            kill_self()  # the previous last moved aside, the new one not yet in place
        if scenario == "link_creation" and name(src) == "last.ckpt.linktmp":
            links.append(1)
            if len(links) == 2:  # step 4's link: made under its temporary name, not renamed over last
                kill_self()
        return real_replace(src, dst, *a, **k)

    def rmtree(path, *a, **k):
        doomed = (scenario == "old_removal" and name(path) == "last.ckpt.old") or (
            scenario in ("delete_older", "link_delete_older") and name(path) == "epoch=0-step=2.ckpt.del")
        if doomed:  # half of it deleted
            files = sorted(Path(path).iterdir())
            for f in files[: max(1, len(files) // 2)]:
                f.unlink()
            kill_self()
        return real_rmtree(path, *a, **k)

    def write_data(self, *a, **k):
        writes.append(1)
        if scenario == "tmp_write" and len(writes) == 3:  # step 2: top-k + last; step 4's top-k
            kill_self()
        return real_write(self, *a, **k)

    def finish_save(tmp, path, blob, **k):
        if scenario in ("async_finalize", "link_async_finalize") and name(path) == "epoch=0-step=4.ckpt":
            kill_self()  # every shard written, nothing recorded, nothing renamed
        return real_finish(tmp, path, blob, **k)

    os.replace, shutil.rmtree = replace, rmtree
    fs.FileSystemWriter.write_data = write_data
    ckpt.finish_save = finish_save


def _crash(rank: int, world: int, out: Path, root: Path, scenario: str) -> None:
    import lightning as L

    save_last, async_save = SCENARIOS[scenario][:2]
    L.seed_everything(0, verbose=False)
    _inject(scenario)
    _trainer(root, save_last, async_save).fit(make_module(), data(GB, 1, SAMPLES))
    raise AssertionError(f"{scenario}: the run survived its crash point")


def _resume(rank: int, world: int, out: Path, root: Path, scenario: str) -> dict:
    import lightning as L

    save_last, async_save = SCENARIOS[scenario][:2]
    left = sorted(p.name for p in (root / "ckpt").iterdir())
    L.seed_everything(0, verbose=False)
    module = make_module()
    _trainer(root, save_last, async_save).fit(module, data(GB, 1, SAMPLES), ckpt_path="last")
    folder = root / "ckpt"
    from lightning_perf.runtime.resume import checkpoint_step

    return {"left": left, "losses": dict(module.losses), "names": sorted(p.name for p in folder.iterdir()),
            "last_is_link": (folder / "last.ckpt").is_symlink(),
            "last_steps": {p.name: checkpoint_step(p) for p in folder.glob("last*.ckpt")}}


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference(STEPS, GB, SAMPLES)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_crash_in_the_save_sequence_resumes_at_the_right_step(scenario, tmp_path, ref) -> None:
    save_last, _, start, left = SCENARIOS[scenario]
    crashed = launch(_crash, 1, tmp_path / "crash", tmp_path, scenario, timeout=120)
    assert crashed.exitcodes == [-9], crashed.errors  # died at the crash point, not of an error
    resumed = launch(_resume, 1, tmp_path / "resume", tmp_path, scenario, timeout=120)
    got = resumed.check_ok()[0]
    assert got["left"] == left  # the crash came where the scenario says
    steps = sorted(got["losses"])
    assert steps == list(range(start, STEPS)), (got["left"], steps)
    torch.testing.assert_close(torch.tensor([got["losses"][s] for s in steps]),
                               torch.tensor([ref["losses"][s] for s in steps]), rtol=1e-5, atol=1e-6)
    # the folder the resumed run leaves: step 6's checkpoint and last, nothing half-done. Complete older
    # checkpoints may stay: the one it resumed from (Lightning never deletes it), one whose deletion
    # waited for the link to move when the crash came. Resumed from the first save of a "link" run,
    # Lightning names its next last last-v1 (that save recorded no last)
    assert "epoch=0-step=6.ckpt" in got["names"] and "last.ckpt" in got["names"], got["names"]
    assert not [n for n in got["names"] if n.endswith((".tmp", ".old", ".del", ".linktmp"))], got["names"]
    allowed = {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"}
    if save_last == "link" and start == 2:
        allowed.add("last-v1.ckpt")
    assert set(got["names"]) <= allowed, got["names"]
    assert max(got["last_steps"].values()) == STEPS and got["last_is_link"] == (save_last == "link")


def test_crash_points_leave_what_the_table_says(tmp_path) -> None:
    """The two states the issue found: ``.old`` + a complete ``.tmp`` (recovered, not started over), and
    a ``last`` link to a checkpoint that is not final (never made)."""
    from lightning_perf.runtime import resume

    launch(_crash, 1, tmp_path / "a" / "out", tmp_path / "a", "between_renames", timeout=120)
    folder = tmp_path / "a" / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt.old", "last.ckpt.tmp"]
    assert resume.is_complete(folder / "last.ckpt.tmp") and resume.checkpoint_step(folder / "last.ckpt.tmp") == 4
    launch(_crash, 1, tmp_path / "b" / "out", tmp_path / "b", "link_async_finalize", timeout=120)
    folder = tmp_path / "b" / "ckpt"
    assert os.readlink(folder / "last.ckpt") == "epoch=0-step=2.ckpt" and resume.is_complete(folder / "last.ckpt")


# ---- what another writer's crash can leave -------------------------------------------------------


def _fit_from_last(rank: int, world: int, out: Path, root: Path, steps: int) -> dict:
    import lightning as L

    L.seed_everything(0, verbose=False)
    module = make_module()
    try:
        _trainer(root, "link", False, steps).fit(module, data(GB, 1, SAMPLES), ckpt_path="last")
    except FileNotFoundError as e:
        return {"refused": str(e), "losses": dict(module.losses)}
    return {"refused": None, "losses": dict(module.losses)}


def test_dangling_last_resumes_from_the_newest_complete_checkpoint(tmp_path, ref) -> None:
    launch(_fit_from_last, 1, tmp_path / "first", tmp_path, 4, timeout=120).check_ok()
    folder = tmp_path / "ckpt"
    (folder / "last.ckpt").unlink()
    os.symlink("epoch=0-step=6.ckpt", folder / "last.ckpt")  # a link made before its target was final
    (folder / "epoch=0-step=6.ckpt.tmp").mkdir()
    outcome = launch(_fit_from_last, 1, tmp_path / "second", tmp_path, STEPS, timeout=120)
    got = outcome.check_ok()[0]
    assert got["refused"] is None and sorted(got["losses"]) == [4, 5]
    log = (tmp_path / "second" / "rank0.log").read_text()
    line = next(ln for ln in log.splitlines() if 'ckpt_path="last"' in ln)
    assert "last.ckpt is not a complete checkpoint" in line and "epoch=0-step=4.ckpt (global step 4)" in line


def test_only_partial_saves_refuse_to_start_over(tmp_path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "last.ckpt.tmp").mkdir(parents=True)
    (folder / "last.ckpt.tmp" / "__0_0.distcp").write_bytes(b"\0" * 64)
    os.symlink("epoch=0-step=2.ckpt", folder / "last.ckpt")
    got = launch(_fit_from_last, 1, tmp_path / "out", tmp_path, STEPS, timeout=120).check_ok()[0]
    assert got["losses"] == {}  # never trained
    assert "holds no complete checkpoint" in got["refused"] and "last.ckpt.tmp (a save that never completed)" \
        in got["refused"] and "which does not exist" in got["refused"]


def test_nothing_at_all_is_a_first_run(tmp_path) -> None:
    got = launch(_fit_from_last, 1, tmp_path / "out", tmp_path, 2, timeout=120).check_ok()[0]
    assert got["refused"] is None and sorted(got["losses"]) == [0, 1]
