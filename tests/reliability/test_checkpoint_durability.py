"""Saves are durable before they are visible, and before an older checkpoint goes (one process).

``os.fsync``, ``os.replace`` and ``shutil.rmtree`` are wrapped to record, in order, what was fsynced
(the path behind the descriptor), renamed and deleted. For a synchronous and a background save, a
first save, an overwrite (through ``<ckpt>.old``) and the removal of an older checkpoint:

- every file of ``<ckpt>.tmp`` is fsynced after it was last written and before the rename, and the
  ``.tmp`` directory after its last file and before the rename;
- after the rename, the parent directory is fsynced before ``.old`` or an older checkpoint is deleted.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.lock = threading.Lock()

    def add(self, *event: str) -> None:
        with self.lock:
            self.events.append(event)

    def index(self, event: tuple[str, ...], since: int = 0) -> int:
        """The first ``event`` at or after position ``since``."""
        for i, e in enumerate(self.events):
            if i >= since and e == event:
                return i
        raise AssertionError(f"{event} never happened from event {since} on: {self.events}")


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    r = Recorder()
    fsync, replace, rmtree = os.fsync, os.replace, shutil.rmtree

    def recording_fsync(fd):
        r.add("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_replace(src, dst, *a, **k):
        r.add("replace", os.path.abspath(src), os.path.abspath(dst))
        return replace(src, dst, *a, **k)

    def recording_rmtree(path, *a, **k):
        r.add("rmtree", os.path.abspath(path))
        return rmtree(path, *a, **k)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    monkeypatch.setattr(shutil, "rmtree", recording_rmtree)
    return r


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _check_commit(rec: Recorder, ckpt: Path, since: int = 0) -> int:
    """The rename of ``ckpt.tmp`` into place came after fsyncs of its files and directory; returns the
    index of the parent directory's fsync that followed it."""
    tmp = str(ckpt.with_name(ckpt.name + ".tmp"))
    rename = rec.index(("replace", tmp, str(ckpt)), since)
    files = sorted(f.name for f in ckpt.iterdir())
    assert {".metadata", "extra.pt"} <= set(files) and any(f.endswith(".distcp") for f in files), files
    last_file = -1
    for name in files:
        synced = [i for i, e in enumerate(rec.events[:rename]) if i >= since and e == ("fsync", f"{tmp}/{name}")]
        assert synced, f"{name} was not fsynced before {tmp} was renamed: {rec.events}"
        last_file = max(last_file, synced[-1])
    dir_synced = [i for i, e in enumerate(rec.events[:rename]) if i > last_file and e == ("fsync", tmp)]
    assert dir_synced, f"{tmp} itself was not fsynced after its files and before the rename: {rec.events}"
    return rec.index(("fsync", str(ckpt.parent)), rename + 1)


def test_sync_saves_are_durable_before_renames_and_deletions(rec: Recorder, tmp_path: Path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import load_checkpoint, remove, save_checkpoint

    tmp_path = tmp_path.resolve()  # paths as /proc names them
    model, opt = _model()
    a, b = tmp_path / "a", tmp_path / "b"
    save_checkpoint(a, model, [opt], extra={"n": 1})
    _check_commit(rec, a)

    # an overwrite: a -> a.old, a.tmp -> a, the parent fsynced, then a.old deleted
    start = len(rec.events)
    save_checkpoint(a, model, [opt], extra={"n": 2})
    old = str(tmp_path / "a.old")
    moved = rec.index(("replace", str(a), old), start)
    parent_synced = _check_commit(rec, a, since=start)
    assert moved < rec.index(("replace", f"{a}.tmp", str(a)), start) < parent_synced
    assert parent_synced < rec.index(("rmtree", old), moved + 1)

    # a newer checkpoint, then the older one removed (what ModelCheckpoint's top-k does)
    start = len(rec.events)
    save_checkpoint(b, model, [opt], extra={"n": 3})
    remove(a)
    parent_synced = _check_commit(rec, b, since=start)
    assert parent_synced < rec.index(("rmtree", str(a)), start)
    assert load_checkpoint(b, _model()[0]) == {"n": 3}


def test_background_saves_are_durable_before_renames_and_deferred_deletions(rec: Recorder, tmp_path: Path) -> None:
    from lightning_perf.parallel import AsyncCheckpointer, load_checkpoint

    tmp_path = tmp_path.resolve()  # paths as /proc names them
    model, opt = _model()
    a, b = tmp_path / "a", tmp_path / "b"
    saver = AsyncCheckpointer()
    try:
        saver.save(a, model, [opt], extra={"n": 1})
        saver.wait()
        _check_commit(rec, a)
        start = len(rec.events)
        saver.save(b, model, [opt], extra={"n": 2})
        saver.remove(a)  # deferred until b is final, or done now if it already is
        saver.wait()
        parent_synced = _check_commit(rec, b, since=start)
        assert parent_synced < rec.index(("rmtree", str(a)), start)
        assert not a.exists()
        # an overwrite in the background
        start = len(rec.events)
        saver.save(b, model, [opt], extra={"n": 3})
        saver.wait()
        old = str(tmp_path / "b.old")
        moved = rec.index(("replace", str(b), old), start)
        parent_synced = _check_commit(rec, b, since=start)
        assert moved < rec.index(("replace", f"{b}.tmp", str(b)), start) < parent_synced
        assert parent_synced < rec.index(("rmtree", old), moved + 1)
    finally:
        saver.close()
    assert load_checkpoint(b, _model()[0]) == {"n": 3}


def test_consolidated_file_and_link_are_durable(rec: Recorder, tmp_path: Path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import consolidate, save_checkpoint, update_link

    tmp_path = tmp_path.resolve()
    model, opt = _model()
    save_checkpoint(tmp_path / "a", model, [opt])
    start = len(rec.events)
    out = consolidate(tmp_path / "a", tmp_path / "out" / "model.pt")
    real = str(out)
    rename = rec.index(("replace", real + ".tmp", real), start)
    assert rec.index(("fsync", real + ".tmp"), start) < rename
    rec.index(("fsync", os.path.dirname(real)), rename + 1)

    start = len(rec.events)
    update_link(tmp_path / "last", tmp_path / "a")
    rename = rec.index(("replace", str(tmp_path / "last.linktmp"), str(tmp_path / "last")), start)
    assert rec.index(("fsync", str(tmp_path)), start) < rename  # the new link's entry, then the rename's
    rec.index(("fsync", str(tmp_path)), rename + 1)
    assert (tmp_path / "last").resolve() == (tmp_path / "a").resolve()
