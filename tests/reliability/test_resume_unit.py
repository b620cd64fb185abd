"""``lightning_perf.runtime.resume`` on folders built by hand (one process, no training), and the
``PreemptionCheckpoint`` arguments it refuses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch


def _save(path: Path, step: int) -> Path:
    from lightning_perf.parallel.checkpointing.checkpoint import save_checkpoint

    torch.manual_seed(step)
    return save_checkpoint(path, torch.nn.Linear(4, 4), extra={"global_step": step})


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_recover_finishes_a_half_done_overwrite(tmp_path) -> None:
    from lightning_perf.runtime import resume

    _save(tmp_path / "last.ckpt.old", 2)
    _save(tmp_path / "last.ckpt.tmp", 4)
    done = resume.recover(tmp_path)
    assert _names(tmp_path) == ["last.ckpt"] and resume.checkpoint_step(tmp_path / "last.ckpt") == 4
    assert len(done) == 2 and "renamed last.ckpt.tmp into place" in done[0]
    assert resume.recover(tmp_path) == []  # nothing left to do


def test_recover_brings_back_the_old_one_when_the_new_one_is_incomplete(tmp_path) -> None:
    from lightning_perf.runtime import resume

    _save(tmp_path / "last.ckpt.old", 2)
    _save(tmp_path / "last.ckpt.tmp", 4)
    (tmp_path / "last.ckpt.tmp" / "extra.pt").write_bytes(b"truncated")
    resume.recover(tmp_path)
    assert _names(tmp_path) == ["last.ckpt", "last.ckpt.tmp"] and resume.checkpoint_step(tmp_path / "last.ckpt") == 2


def test_recover_removes_leftovers_and_never_a_lone_copy(tmp_path) -> None:
    from lightning_perf.runtime import resume

    _save(tmp_path / "last.ckpt", 4)
    _save(tmp_path / "last.ckpt.old", 2)  # the replacement completed: redundant
    _save(tmp_path / "epoch=0-step=2.ckpt.del", 2)  # a deletion under way
    os.symlink("epoch=0-step=4.ckpt", tmp_path / "last.ckpt.linktmp")
    _save(tmp_path / "epoch=0-step=6.ckpt.tmp", 6)  # complete but never renamed, beside nothing: its save
    resume.recover(tmp_path)
    assert _names(tmp_path) == ["epoch=0-step=6.ckpt", "last.ckpt"]


def test_a_shard_of_the_wrong_size_is_not_complete(tmp_path) -> None:
    from lightning_perf.runtime import resume

    path = _save(tmp_path / "a.ckpt", 1)
    assert resume.is_complete(path)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    assert not resume.is_complete(path) and resume.newest_complete([tmp_path]) is None


def test_point_link_replaces_a_directory_and_a_link(tmp_path) -> None:
    from lightning_perf.runtime import resume

    _save(tmp_path / "last.ckpt", 2)  # a full last (save_last=True) becoming a link
    _save(tmp_path / "epoch=0-step=4.ckpt", 4)
    resume.point_link(tmp_path / "last.ckpt", tmp_path / "epoch=0-step=4.ckpt")
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=0-step=4.ckpt"
    assert resume.linked_to(tmp_path / "epoch=0-step=4.ckpt") == [tmp_path / "last.ckpt"]
    _save(tmp_path / "epoch=0-step=6.ckpt", 6)
    resume.point_link(tmp_path / "last.ckpt", tmp_path / "epoch=0-step=6.ckpt")
    assert _names(tmp_path) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert resume.linked_to(tmp_path / "epoch=0-step=4.ckpt") == []


def test_discard_renames_before_it_deletes(tmp_path, monkeypatch) -> None:
    from lightning_perf.runtime import resume

    _save(tmp_path / "epoch=0-step=2.ckpt", 2)
    seen = []
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: seen.append(Path(p).name))
    resume.discard(tmp_path / "epoch=0-step=2.ckpt")
    assert seen == ["epoch=0-step=2.ckpt.del"] and _names(tmp_path) == ["epoch=0-step=2.ckpt.del"]


@pytest.mark.parametrize("bad", ["SIGFOO", 9, "KILL"])
def test_preemption_refuses_signals_it_cannot_take(bad) -> None:
    from lightning_perf.callbacks import PreemptionCheckpoint

    with pytest.raises(ValueError, match="PreemptionCheckpoint"):
        PreemptionCheckpoint(signals=(bad,))
    assert PreemptionCheckpoint(signals=("term", "USR1", 2)).signals == (15, 10, 2)
