"""What ``ckpt_path="last"`` resumes from, and a checkpoint folder that a crash cannot leave without one.

The pack's save sequence (:mod:`lightning_perf.parallel.checkpointing.checkpoint`, :mod:`...async_checkpoint`)
writes a checkpoint into ``<name>.tmp`` and renames it into place; overwriting one (``last.ckpt``)
takes two renames (``<name>`` to ``<name>.old``, ``<name>.tmp`` to ``<name>``). A crash between them
leaves ``<name>.old`` and a complete ``<name>.tmp`` and no ``<name>``. Here:

- :func:`recover` finishes or undoes such a half-done rename (a complete ``.tmp`` whose ``<name>`` is
  gone is renamed into place; a complete ``.old`` whose ``<name>`` is gone comes back), drops an
  ``.old`` whose ``<name>`` is complete, and the leftovers of an interrupted deletion (``.del``) or
  link update (``.linktmp``). It never removes a complete checkpoint that has no other copy.
- :func:`resume_path` is what ``ckpt_path="last"`` means once recovered: Lightning's own ``last``
  when one exists, is complete and no other complete checkpoint of the folders holds a later step;
  otherwise the newest complete checkpoint of the checkpoint folders (by global step), named in one
  printed line; otherwise, when the folders hold only partial saves or dangling links, a
  ``FileNotFoundError`` saying so. Only with nothing there at all (a first run) does it leave
  ``"last"`` to Lightning, which then starts from step 0.
- :func:`point_link` moves a symlink atomically (a link is never missing), :func:`discard` deletes a
  checkpoint by renaming it to ``<name>.del`` first (a half-deleted checkpoint never looks like one),
  :func:`linked_to` tells whether a link of its folder points at a checkpoint.

A checkpoint is *complete* when it is a directory whose ``extra.pt`` (written last) reads back and
whose files have the sizes that ``extra.pt`` records, or a Lightning checkpoint file that opens.
Checksums are not read here (a load checks them): finding a checkpoint stays cheap at any size.
"""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from lightning_perf.parallel.checkpointing.checkpoint import EXTRA_FILE

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "GARBAGE_SUFFIXES",
    "checkpoint_dirs",
    "checkpoint_step",
    "discard",
    "is_complete",
    "linked_to",
    "newest_complete",
    "point_link",
    "recover",
    "resume_path",
]

PathLike = Union[str, os.PathLike]
# names the save sequence gives to what is not (yet, or any more) a checkpoint
TMP, OLD, DEL, LINKTMP = ".tmp", ".old", ".del", ".linktmp"
GARBAGE_SUFFIXES = (TMP, OLD, DEL, LINKTMP)


# ---- what a checkpoint is ------------------------------------------------------------------------


def _read_blob(path: Path) -> Optional[dict[str, Any]]:
    try:
        blob = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
    except Exception:  # missing, truncated, or not ours
        return None
    return blob if isinstance(blob, dict) else None


def is_complete(path: PathLike) -> bool:
    """Whether ``path`` (followed if a link) is a whole checkpoint: see the module docstring."""
    p = Path(path)
    if p.is_dir():
        blob = _read_blob(p)
        if blob is None:
            return False
        for name, entry in (blob.get("files") or {}).items():
            f = p / name
            if not f.is_file() or f.stat().st_size != int(entry[0]):
                return False
        return True
    if p.is_file():
        try:
            with zipfile.ZipFile(p) as z:  # torch.save's format: the index sits at the end of the file
                return bool(z.namelist())
        except (OSError, zipfile.BadZipFile):
            return False
    return False


def checkpoint_step(path: PathLike) -> Optional[int]:
    """The global step a complete checkpoint was saved at (None if it does not record one)."""
    p = Path(path)
    if p.is_dir():
        blob = _read_blob(p) or {}
        extra = blob.get("extra") or {}
        nested = extra.get("lightning")
        if len(extra) == 1 and isinstance(nested, dict):
            extra = nested
        step = extra.get("global_step")
    else:
        try:
            step = torch.load(p, map_location="cpu", weights_only=True, mmap=True).get("global_step")
        except Exception:
            return None
    return int(step) if isinstance(step, int) else None


def _is_garbage(name: str) -> bool:
    return name.endswith(GARBAGE_SUFFIXES)


# ---- deleting and linking without a window -------------------------------------------------------


def discard(path: PathLike) -> None:
    """Delete a checkpoint (directory, file or link); a directory is renamed to ``<name>.del`` first."""
    p = Path(path)
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
        return
    if not p.is_dir():
        return
    gone = p.with_name(p.name + DEL)
    if gone.is_dir() and not gone.is_symlink():
        shutil.rmtree(gone, ignore_errors=True)
    os.replace(p, gone)
    shutil.rmtree(gone, ignore_errors=True)


def point_link(link: PathLike, target: PathLike) -> None:
    """Point symlink ``link`` at ``target`` (relative) with one rename: ``link`` is never missing.

    A real directory at ``link`` (a full ``last`` of ``save_last=True``) is moved to ``<link>.old``
    first and deleted after the rename, so a crash between the two leaves a complete ``.old`` that
    :func:`recover` brings back.
    """
    link, target = Path(link), Path(target)
    tmp = link.with_name(link.name + LINKTMP)
    if tmp.is_symlink() or tmp.exists():
        discard(tmp)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    if link.is_dir() and not link.is_symlink():
        old = link.with_name(link.name + OLD)
        if old.exists() or old.is_symlink():
            discard(old)
        os.replace(link, old)
        os.replace(tmp, link)
        discard(old)
    else:
        os.replace(tmp, link)


def linked_to(path: PathLike) -> list[Path]:
    """The symlinks of ``path``'s folder that point at ``path``."""
    p = Path(path)
    if not p.parent.is_dir():
        return []
    try:
        real = Path(os.path.realpath(p))
        return [e for e in p.parent.iterdir() if e.is_symlink() and e != p and Path(os.path.realpath(e)) == real]
    except OSError:
        return []


# ---- recovery ------------------------------------------------------------------------------------


def _missing(p: Path) -> bool:
    """No checkpoint at ``p``: nothing there, or a link that dangles."""
    return not p.exists()


def recover(folder: PathLike) -> list[str]:
    """Repair what a crash in the middle of the save sequence left in ``folder``; what was done, one line each.

    Run by one process while no save is under way (at the start of a fit). Safe to run while other
    processes look at the folder: every step is one rename or the deletion of a redundant copy.
    """
    d = Path(folder)
    if not d.is_dir():
        return []
    done: list[str] = []

    def entries() -> list[Path]:
        try:
            return sorted(d.iterdir())
        except OSError:
            return []

    for e in entries():  # the leftovers of a deletion or a link update under way
        if e.name.endswith((DEL, LINKTMP)):
            try:
                if e.is_dir() and not e.is_symlink():
                    shutil.rmtree(e)
                else:
                    e.unlink()
                done.append(f"removed the leftover {e.name}")
            except OSError:
                pass
    for e in entries():  # <name>.tmp complete, <name> gone: the second rename did not happen
        if not e.name.endswith(TMP) or e.is_symlink():
            continue
        final = e.with_name(e.name[: -len(TMP)])
        if _missing(final) and is_complete(e):
            try:
                if final.is_symlink():  # a dangling link in its place
                    final.unlink()
                os.replace(e, final)
                done.append(f"finished the interrupted save of {final.name} (renamed {e.name} into place)")
            except OSError:
                pass
    for e in entries():
        if not e.name.endswith(OLD) or e.is_symlink():
            continue
        final = e.with_name(e.name[: -len(OLD)])
        try:
            if _missing(final) and is_complete(e):
                if final.is_symlink():
                    final.unlink()
                os.replace(e, final)
                done.append(f"restored {final.name} from {e.name} (its replacement never completed)")
            elif not _missing(final) and is_complete(final):
                discard(e)
                done.append(f"removed {e.name} (the save that replaced it completed)")
        except OSError:
            pass
    return done


# ---- what to resume from -------------------------------------------------------------------------


def checkpoint_dirs(trainer: "pl.Trainer", *, resolve: bool = True) -> list[Path]:
    """The local folders the trainer's ``ModelCheckpoint`` callbacks write full checkpoints to; those without
    a ``dirpath`` resolved as Lightning does (``resolve``) or left out."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out: list[Path] = []
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint) or cb.save_weights_only:
            continue  # weights only: nothing to resume a fit from
        folder = cb.dirpath
        if folder is None and resolve:  # a logger's versioned folder: what Lightning's "last" looks in
            resolve = getattr(cb, "_ModelCheckpoint__resolve_ckpt_dir", None)
            folder = resolve(trainer) if callable(resolve) else None
        if folder is None or "://" in str(folder) and not str(folder).startswith("file://"):
            continue  # remote storage: left to Lightning
        p = Path(str(folder).removeprefix("file://"))
        if p not in out:
            out.append(p)
    return out


def _lightning_lasts(trainer: "pl.Trainer") -> set[Path]:
    """What Lightning's ``ckpt_path="last"`` looks at: the callbacks' ``last*.ckpt`` names."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    found: set[Path] = set()
    for cb in trainer.callbacks:
        if isinstance(cb, OnExceptionCheckpoint) and getattr(cb, "ckpt_path", None):
            found.add(Path(cb.ckpt_path))
        elif isinstance(cb, ModelCheckpoint):
            try:
                found |= {Path(p) for p in cb._find_last_checkpoints(trainer)}
            except Exception:  # remote storage, an unreadable folder: Lightning's to report
                pass
    return found


def _names(folders: Iterable[Path], extension: str) -> list[Path]:
    out = []
    for d in folders:
        try:
            out += [e for e in sorted(d.iterdir()) if extension in e.name]
        except OSError:
            pass
    return out


def _recoverable(e: Path) -> bool:
    """A complete ``<name>.tmp`` / ``<name>.old`` that :func:`recover` would rename to its missing ``<name>``."""
    for suffix in (TMP, OLD):
        if e.name.endswith(suffix) and not e.is_symlink():
            return _missing(e.with_name(e.name[: -len(suffix)])) and is_complete(e)
    return False


def newest_complete(folders: Iterable[PathLike], extension: str = ".ckpt", *,
                    unrecovered: bool = False) -> Optional[Path]:
    """The complete checkpoint of ``folders`` with the highest global step (then the newest); links skipped.

    ``unrecovered``: count the ``.tmp`` / ``.old`` copies that :func:`recover` would put back too
    (what a process that does not repair the folder sees while another one does).
    """
    best: Optional[tuple[int, float, Path]] = None
    for e in _names([Path(f) for f in folders], extension):
        if e.is_symlink():
            continue
        if _is_garbage(e.name) and not (unrecovered and _recoverable(e)):
            continue
        try:
            if not is_complete(e):
                continue
            step = checkpoint_step(e)
            key = (-1 if step is None else step, e.stat().st_mtime, e)
        except OSError:  # renamed or removed meanwhile
            continue
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


def _remnants(folders: Iterable[Path], extension: str) -> list[str]:
    out = []
    for e in _names(folders, extension):
        if e.is_symlink() and not e.exists():
            out.append(f"{e.name} (a link to {os.readlink(e)}, which does not exist)")
        elif e.name.endswith(TMP):
            out.append(f"{e.name} (a save that never completed)")
        elif e.exists() and not _is_garbage(e.name) and not is_complete(e):
            out.append(f"{e.name} (incomplete)")
    return out


def resume_path(trainer: "pl.Trainer", ckpt_path: Any, *, repair: bool = True,
                announce: bool = True) -> Any:
    """``ckpt_path`` as the fit should get it, after repairing the checkpoint folders (``repair``).

    Only ``"last"`` changes: to the newest complete checkpoint when Lightning would find no complete
    ``last`` (with one line saying so when ``announce``), or a ``FileNotFoundError`` when the folders
    hold nothing complete but what a crash left. ``repair``: run :func:`recover` on each folder (one
    process of the job: the others only look).
    """
    folders = checkpoint_dirs(trainer, resolve=ckpt_path == "last")
    for d in folders if repair else []:
        for line in recover(d):
            if announce:
                print(f"lightning_perf: {d}: {line}", flush=True)
    if ckpt_path != "last":
        return ckpt_path
    # a process that does not repair may look while another one renames: it looks again before it refuses
    for attempt in range(20):
        try:
            return _resolve_last(trainer, folders, repair=repair, announce=announce)
        except FileNotFoundError:
            if repair or attempt == 19:
                raise
            time.sleep(0.1)
    return "last"


def _resolve_last(trainer: "pl.Trainer", folders: list[Path], *, repair: bool, announce: bool) -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    extension = next((cb.FILE_EXTENSION for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)),
                     ".ckpt")
    lasts = _lightning_lasts(trainer)
    whole = [p for p in lasts if is_complete(p)]
    newest = newest_complete(folders, extension, unrecovered=not repair)
    newest_step = -1 if newest is None else (checkpoint_step(newest) if checkpoint_step(newest) is not None else -1)
    if whole:
        steps = {p: checkpoint_step(p) for p in whole}
        last_step = max(-1 if s is None else s for s in steps.values())
        if newest is None or newest_step <= last_step:
            return "last"  # Lightning picks the newest of them
        # a crash between the save of a step's checkpoint and of its last: the newer one is complete
        shown = max(steps, key=lambda p: -1 if steps[p] is None else steps[p])
        why = f"{shown.name} holds global step {last_step}, {newest.name} is newer"
    else:
        why = (f"{', '.join(sorted(p.name for p in lasts))} is not a complete checkpoint" if lasts
               else "there is no last checkpoint")
    if newest is not None:
        if announce:
            at = f" (global step {newest_step})" if newest_step >= 0 else ""
            print(f'lightning_perf: ckpt_path="last": {why}; resuming from {newest}{at}, the newest complete '
                  f"checkpoint in {newest.parent}", flush=True)
        return str(newest)
    remnants = _remnants(folders, extension)
    if remnants:
        raise FileNotFoundError(
            f'ckpt_path="last": {why} and {", ".join(str(d) for d in folders)} holds no complete checkpoint, only '
            f"{'; '.join(remnants)}. Nothing was loaded and training did not start over: pass ckpt_path=None to "
            "start from step 0 (or the path of a checkpoint kept elsewhere)"
        )
    return "last"  # a first run: Lightning warns that there is none and starts from step 0
