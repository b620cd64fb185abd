"""Damaged checkpoints fail loudly, naming the file, and load nothing (one process).

Atomic saves (a partial ``.tmp``, a crash between the renames, the ``last`` link) and the
refusal of arbitrary pickled objects are in ``tests/parallel/test_zero_parallel.py``; a
rank killed inside ``dcp.save`` of a 2-rank run in ``test_crash_resume.py``. Here: every
byte of a shard file flipped in turn (no silent partial load, anywhere in the file), a
truncated or missing shard, a truncated ``.metadata`` / ``extra.pt``, a pickle whose
loading would run code, and a checkpoint from before the file manifest existed.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from lightning_perf.parallel.checkpointing.checkpoint import save_checkpoint

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("ck") / "step1"
    save_checkpoint(path, model, [opt], extra={"step": 1})
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def _copy(saved, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved[0], dst)
    return dst


def _load(path: Path):
    from lightning_perf.parallel.checkpointing.checkpoint import load_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        return load_checkpoint(path, model, [opt]), model
    except Exception:
        for k, v in model.state_dict().items():  # a refused load leaves the model untouched
            assert torch.equal(v, before[k]), k
        raise


def _shard(path: Path) -> Path:
    return next(f for f in path.iterdir() if f.suffix == ".distcp")


def test_intact_checkpoint_loads(saved, tmp_path) -> None:
    extra, model = _load(_copy(saved, tmp_path))
    assert extra == {"step": 1}
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[1][k])


def test_every_flipped_byte_of_a_shard_is_caught(saved, tmp_path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import CheckpointCorruptError

    path = _copy(saved, tmp_path)
    shard = _shard(path)
    good = shard.read_bytes()
    for offset in range(0, len(good), max(1, len(good) // 64)):
        bad = bytearray(good)
        bad[offset] ^= 0x10
        shard.write_bytes(bytes(bad))
        with pytest.raises(CheckpointCorruptError, match=f"{shard.name} is corrupted"):
            _load(path)
    shard.write_bytes(good)
    _load(path)


@pytest.mark.parametrize("damage", ["truncate_shard", "missing_shard", "truncate_metadata"])
def test_truncated_or_missing_files_are_named(saved, tmp_path, damage: str) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import CheckpointCorruptError

    path = _copy(saved, tmp_path)
    target = path / ".metadata" if damage == "truncate_metadata" else _shard(path)
    if damage == "missing_shard":
        target.unlink()
        match = f"{target} is missing"
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        match = f"{target} is truncated"
    with pytest.raises(CheckpointCorruptError, match=match):
        _load(path)


def test_unreadable_extra_file_is_named(saved, tmp_path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import CheckpointCorruptError

    path = _copy(saved, tmp_path)
    extra = path / "extra.pt"
    extra.write_bytes(extra.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match="extra.pt is unreadable"):
        _load(path)
    with pytest.raises(CheckpointCorruptError):  # ValueError: callers catching bad input see it too
        from lightning_perf.parallel.checkpointing.checkpoint import consolidate

        consolidate(path, tmp_path / "out.pt")


class _Payload:
    """Unpickling this object would create a file: it must never run."""

    marker = ""

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_code_is_refused_and_never_runs(saved, tmp_path) -> None:
    path = _copy(saved, tmp_path)
    blob = torch.load(path / "extra.pt", weights_only=True)
    _Payload.marker = str(tmp_path / "pwned")
    blob["extra"] = {"evil": _Payload()}
    torch.save(blob, path / "extra.pt")
    with pytest.raises(pickle.UnpicklingError):
        _load(path)
    assert not (tmp_path / "pwned").exists()


def test_checkpoint_without_manifest_still_fails_with_its_path(saved, tmp_path) -> None:
    path = _copy(saved, tmp_path)
    blob = torch.load(path / "extra.pt", weights_only=True)
    del blob["files"]  # saved before sizes and checksums were recorded
    torch.save(blob, path / "extra.pt")
    shard = _shard(path)
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(RuntimeError, match=f"reading checkpoint {path} failed"):
        _load(path)
