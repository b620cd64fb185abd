"""Sharded, atomic, reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of one checkpoint directory::

    ckpt/                      one directory per checkpoint
      .metadata, __0_0.distcp  DCP: {"model": model state, "optim": {"state": optimizer state}}
      extra.pt                 rank 0: caller's extra state (loss scaler, loop counters,
                               ...) and the optimizer hyper-parameters, loadable with
                               ``torch.load(weights_only=True)``

Model and optimizer states come from ``get_state_dict`` / go back through
``set_state_dict``, so FSDP2 and tensor-parallel DTensors, plain replicated modules and
the rank-local optimizer of a ``ZeroRedundancyOptimizer`` all save their own shard, keyed
by parameter name. Loading reads whatever slices the new layout needs: a checkpoint saved
by 4 ranks loads on 2 (or under a different mesh).

Saves are atomic: every rank writes into ``<ckpt>.tmp``; rank 0 renames it into place
only after all ranks finished, so a crash mid-save leaves the previous checkpoint
intact (and ``load_checkpoint`` falls back to ``<ckpt>.old`` if it crashed between the two
renames of an overwrite). :func:`update_link` moves a ``last`` symlink atomically.
A step of a save that fails on one rank (the ``.tmp`` folder, a file's record, ``extra.pt``,
the rename) fails on every rank at the collective that ends it (:func:`agreed`), so no rank
waits for a peer that has given up until the group's timeout.

Saves record every file's size and CRC-32 in ``extra.pt`` (each rank checksums a share of
the files, read back from the page cache); loads check them first (again shared over the
ranks), so a truncated, missing or altered file fails with :class:`CheckpointCorruptError`
naming it instead of loading part of a checkpoint. The CRC is integrity, not authentication: what
keeps a load from running code is that no pickle is read unrestricted (the DCP metadata through an
allow-list, ``extra.pt`` and non-tensor entries with ``weights_only=True``; see
:mod:`lightning_perf.parallel.checkpointing.checkpoint_io`). Every file and directory is fsynced before the rename
that makes a checkpoint visible, and the rename before the checkpoint it replaces is deleted.

:func:`consolidate` turns a checkpoint into one ``state_dict`` file that a plain
single-device model loads (``GPT(config).load_state_dict(torch.load(f, weights_only=True))``),
and writes the LightningModule's hyper-parameters (the GPT config among them) beside it as
``<file>.json`` (:func:`consolidated_hparams_path`), so ``generate`` and ``convert`` can rebuild the model.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from lightning_perf.parallel.checkpointing.checkpoint_io import (
    CheckpointCorruptError,
    fsync_dir,
    fsync_file,
    read_dcp_metadata,
    torch_load_weights,
    unsafe_error,
)
from lightning_perf.parallel.sharding.ddp import local_optimizer
from lightning_perf.parallel.sharding.fp8_all_gather import plain_state_dict

__all__ = [
    "CheckpointCorruptError",
    "save_checkpoint",
    "load_checkpoint",
    "is_checkpoint",
    "read_extra",
    "verify_files",
    "consolidate",
    "consolidated_state_dict",
    "consolidated_hparams_path",
    "read_consolidated_hparams",
    "update_link",
    "remove",
    "prepare_tmp",
    "commit_tmp",
    "sharded_state",
    "finish_save",
    "resolve",
    "full_model_state_dict",
    "sync_files",
    "write_shards",
    "agreed",
    "CheckpointSaveError",
    "main",
]

EXTRA_FILE = "extra.pt"
_FORMAT = 1
PathLike = Union[str, os.PathLike]
T = TypeVar("T")


class CheckpointSaveError(RuntimeError):
    """A step of a save failed on some rank; raised on every rank of the save's group."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_rank(group) if _dist() else 0


def _barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if _dist():
        dist.barrier(group=group)


def _local_optimizers(optimizers: Sequence[Optimizer]) -> list[Optimizer]:
    return [local_optimizer(o) for o in optimizers]


def _hyperparams(osd: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _record(file: Path, checksum: bool) -> list[int]:
    """``[size, crc32 or -1]`` of a written file, flushed to the device first."""
    fsync_file(file)
    return [file.stat().st_size, _crc32(file) if checksum else -1]


def sync_files(tmp: Path, *, group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank of ``group`` fsyncs a share of the files under ``tmp`` (for saves that write no manifest)."""
    names = [str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file()]
    for name in _my_share(names, group):
        fsync_file(tmp / name)


def _fsync_dirs(top: Path) -> None:
    """fsync every directory under ``top`` (deepest first), then ``top``: their entries are on disk."""
    for d in sorted((p for p in top.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts)):
        fsync_dir(d)
    fsync_dir(top)


def _my_share(names: list[str], group: Optional[dist.ProcessGroup]) -> list[str]:
    world = dist.get_world_size(group) if _dist() else 1
    return [n for i, n in enumerate(sorted(names)) if i % world == _rank(group)]


def agreed(what: str, step: Callable[[], T], *, group: Optional[dist.ProcessGroup] = None) -> T:
    """``step()`` on this rank; if it raised on any rank of ``group``, :class:`CheckpointSaveError` on every rank.

    Collective (one ``all_gather_object`` of the outcome, which is also a barrier): every rank calls it
    at the same point, so a rank whose step failed still meets the others there instead of leaving
    them waiting in the save's next collective. The error names each failed rank and its error.
    """
    error: Optional[BaseException] = None
    value: Any = None
    try:
        value = step()
    except Exception as e:
        error = e
    if not _dist():
        if error is not None:
            raise error
        return value
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
    failed = {r: o for r, o in enumerate(outcomes) if o is not None}
    if failed:
        detail = "; ".join(f"rank {r}: {o}" for r, o in failed.items())
        raise CheckpointSaveError(f"{what} failed on rank(s) {sorted(failed)} ({detail})", sorted(failed)) from error
    return value


def _gather_dicts(part: dict[str, Any], group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    if not _dist():
        return dict(part)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return {k: v for p in parts for k, v in p.items()}


def _manifest(tmp: Path, checksum: bool, group: Optional[dist.ProcessGroup]) -> dict[str, list[int]]:
    """``{file: [size, crc32 or -1]}`` of the checkpoint's files (every rank checksums a share)."""
    names = [f.name for f in tmp.iterdir() if f.is_file() and f.name != EXTRA_FILE]
    part = agreed(f"recording the files of {tmp}",  # each file fsynced
                  lambda: {n: _record(tmp / n, checksum) for n in _my_share(names, group)}, group=group)
    return _gather_dicts(part, group)


def verify_files(
    path: PathLike, files: dict[str, Any], *, group: Optional[dist.ProcessGroup] = None, local: bool = False
) -> None:
    """Check the files of checkpoint ``path`` against the saved manifest.

    Every rank of ``group`` checks a share and the findings are gathered; ``local=True`` checks
    every file in this process and uses no collective (for single-process tools such as
    :func:`consolidate`, which may run on one rank of a live process group).
    """
    path = Path(path)
    problems: dict[str, str] = {}
    for name in (sorted(files) if local else _my_share(list(files), group)):
        size, crc = files[name]
        f = path / name
        if not f.is_file():
            problems[name] = f"{f} is missing"
        elif f.stat().st_size != size:
            problems[name] = f"{f} is truncated or overwritten: {f.stat().st_size} bytes, saved with {size}"
        elif crc >= 0 and _crc32(f) != crc:
            problems[name] = f"{f} is corrupted: its CRC-32 differs from the one recorded at save time"
    if not local:
        problems = _gather_dicts(problems, group)
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged, nothing was loaded: " + "; ".join(problems[k] for k in sorted(problems))
            + ". Resume from an earlier checkpoint."
        )


def is_checkpoint(path: PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / EXTRA_FILE).is_file()


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    extra: Optional[dict[str, Any]] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    checksum: bool = True,
) -> Path:
    """Save ``model`` + ``optimizers`` shards (every rank) and ``extra`` (rank 0) to directory ``path``.

    ``extra`` must hold only what ``torch.load(weights_only=True)`` accepts (tensors,
    numbers, strings, lists, tuples, dicts). Collective: every rank of ``group`` calls it.
    ``checksum``: record each file's CRC-32 (sizes are always recorded).
    """
    path = Path(path)
    tmp = prepare_tmp(path, group=group)
    state, blob = agreed(f"reading the state to save into {path}", lambda: sharded_state(model, optimizers, extra),
                         group=group)
    write_shards(state, tmp, group=group)
    finish_save(tmp, path, blob, checksum=checksum, group=group)
    return path


def write_shards(state: dict[str, Any], tmp: Path, *, group: Optional[dist.ProcessGroup] = None,
                 from_host: bool = False) -> None:
    """DCP's save of this rank's shards into ``tmp`` (collective); a failure on any rank raises
    :class:`CheckpointSaveError` on every rank, naming each failed rank's error.

    ``from_host``: the tensors are host copies (a staged state): DCP's writer reads each as it is
    (``per_thread_copy_ahead=0``) instead of queueing device-to-host copies on the current CUDA
    stream, so the calling thread makes no accelerator call.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(tmp), per_thread_copy_ahead=0) if from_host else FileSystemWriter(str(tmp))
    try:
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=not _dist())
    except BaseException as e:  # DCP's CheckpointException (every rank's errors) derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise CheckpointSaveError(f"writing the shards of {tmp} failed: {_dcp_errors(e)}", _dcp_ranks(e)) from e


def _dcp_ranks(error: BaseException) -> list[int]:
    failures = getattr(error, "failures", None)
    return sorted(failures) if isinstance(failures, dict) else []


def _dcp_errors(error: BaseException) -> str:
    """Each failed rank's error from DCP's exception (its message is every rank's whole traceback)."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        lines = [line for line in str(error).splitlines() if line.strip()]
        return lines[-1] if lines else type(error).__name__
    parts = []
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure  # (exception, its frames)
        parts.append(f"rank {rank}: {type(error).__name__}: {error}")
    return "; ".join(parts)


def sharded_state(
    model: nn.Module, optimizers: Sequence[Optimizer] = (), extra: Optional[dict[str, Any]] = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a save writes: the DCP state (this rank's shards) and rank 0's ``extra.pt`` blob, less the manifest."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    optims = _local_optimizers(optimizers)
    msd, osd = get_state_dict(model, optims) if optims else (get_model_state_dict(model), {})
    state: dict[str, Any] = {"model": plain_state_dict(msd)}  # FP8-gathering shards as plain tensors
    if optims:
        state["optim"] = {"state": osd["state"]}
    blob = {
        "format": _FORMAT,
        "backend": "dcp",
        "extra": extra or {},
        "param_groups": _hyperparams(osd),
        "has_optim": bool(optims),
    }
    return state, blob


def finish_save(
    tmp: Path, path: PathLike, blob: dict[str, Any], *, checksum: bool = True,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """After every rank's shards are in ``tmp``: the manifest, rank 0's ``extra.pt``, the rename (collective)."""
    files = _manifest(tmp, checksum, group)

    def write_blob() -> None:
        if _rank(group) == 0:
            torch.save({**blob, "files": files}, tmp / EXTRA_FILE)
            fsync_file(tmp / EXTRA_FILE)

    agreed(f"writing {tmp / EXTRA_FILE}", write_blob, group=group)
    commit_tmp(tmp, path, group=group)


def prepare_tmp(path: PathLike, *, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Rank 0 creates an empty ``<path>.tmp``; every rank returns it after a barrier."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")

    def make() -> None:
        if _rank(group) == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)

    agreed(f"preparing {tmp}", make, group=group)
    return tmp


def commit_tmp(tmp: Path, path: PathLike, *, group: Optional[dist.ProcessGroup] = None) -> None:
    """After every rank wrote into ``tmp``: rank 0 renames it to ``path`` (the old one to ``.old`` meanwhile).

    The files in ``tmp`` must be on disk already (``finish_save`` fsyncs them); ``tmp``'s directory
    entries are fsynced before the renames and the parent's (the renames) before ``.old`` is deleted.
    """
    path = Path(path)
    _barrier(group)

    def rename() -> None:
        if _rank(group) != 0:
            return
        _fsync_dirs(tmp)
        if path.is_symlink() or path.is_file():
            path.unlink()
        if path.exists():
            old = path.with_name(path.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp, path)
            fsync_dir(path.parent)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
            fsync_dir(path.parent)

    agreed(f"renaming {tmp} to {path.name}", rename, group=group)


def resolve(path: PathLike) -> Path:
    """``path``, or ``<path>.old`` when a crash hit between the two renames of an overwrite."""
    p = Path(path)
    if is_checkpoint(p):
        return p
    old = p.with_name(p.name + ".old")
    if not p.exists() and is_checkpoint(old):
        return old
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist (expected a checkpoint directory with {EXTRA_FILE} inside)")
    raise FileNotFoundError(f"{p} is not a checkpoint directory (expected {EXTRA_FILE} inside)")




def read_extra(path: PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """The ``extra.pt`` blob of a checkpoint (``extra``, optimizer hyper-parameters).

    A pickled object that ``weights_only`` loading refuses raises
    :class:`~lightning_perf.parallel.checkpointing.checkpoint_io.UnsafeCheckpointError` (a ``pickle.UnpicklingError``);
    an unreadable file raises :class:`CheckpointCorruptError` naming it.
    """
    f = resolve(path) / EXTRA_FILE
    if not weights_only:
        _unverified(f"{f} is unpickled with weights_only=False: any object in it is rebuilt, code included")
    try:
        if weights_only:
            return torch_load_weights(f, map_location="cpu")
        return torch.load(f, map_location="cpu", weights_only=False)
    except pickle.UnpicklingError:
        raise
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{f} is unreadable (truncated or corrupted): {e}") from e


def _unverified(what: str) -> None:
    """Warn (once per call site) that a load skips one of the checks the docs list."""
    warnings.warn(f"{what}; load only checkpoints you trust (docs/reliability.md, 'What a load checks')",
                  UserWarning, stacklevel=3)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool = True,
    group: Optional[dist.ProcessGroup] = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load shards into ``model`` (+ ``optimizers``), resharding as needed; return ``extra``.

    ``verify``: check every file's size and CRC-32 against the save-time manifest first
    (``False`` warns that the files are not checked). The DCP metadata is read through an allow-list
    and non-tensor entries with ``weights_only=True`` either way (see
    :mod:`lightning_perf.parallel.checkpointing.checkpoint_io`); ``weights_only=False`` lifts the restriction on
    ``extra.pt`` and those entries, with a warning.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from lightning_perf.parallel.checkpointing.checkpoint_io import SafeFileSystemReader, SafeLoadPlanner

    path = resolve(path)
    blob = read_extra(path, weights_only=weights_only)
    if blob.get("backend", "dcp") != "dcp":
        raise ValueError(f"{path} was written by the {blob['backend']} backend; resume it with that backend")
    if verify and "files" in blob:
        verify_files(path, blob["files"], group=group)
    elif _rank(group) == 0:
        _unverified(f"the files of {path} are not checked against their saved sizes and CRC-32 "
                    + ("(verify=False)" if not verify else "(saved without a file manifest)"))
    metadata = read_dcp_metadata(path)  # before torch reads it: refuses a planted object
    optims = _local_optimizers(optimizers)
    if optims and not blob.get("has_optim", False):
        raise ValueError(f"{path} holds no optimizer state; load it with optimizers=()")
    msd, osd = get_state_dict(model, optims) if optims else (get_model_state_dict(model), {})
    state: dict[str, Any] = {"model": plain_state_dict(msd)}  # FP8-gathering shards as plain tensors
    if optims:
        state["optim"] = {"state": osd["state"]}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata),
                 planner=SafeLoadPlanner(path) if weights_only else None, process_group=group, no_dist=not _dist())
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        unsafe = unsafe_error(e)
        if unsafe is not None:
            raise unsafe from e
        lines = str(e).splitlines() or [""]
        first = next((line for line in lines if "Error" in line), lines[0])
        raise RuntimeError(f"reading checkpoint {path} failed ({first.strip()})") from e
    options = StateDictOptions(strict=strict)
    if optims:
        osd["state"] = state["optim"]["state"]
        for group_now, saved in zip(osd["param_groups"], blob["param_groups"]):
            group_now.update(saved)
        set_state_dict(model, optims, model_state_dict=state["model"], optim_state_dict=osd, options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    return blob["extra"]


def remove(path: PathLike) -> None:
    """Delete a checkpoint: a sharded directory as a whole, a file or a link (no collective)."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def update_link(link: PathLike, target: PathLike) -> None:
    """Point symlink ``link`` at ``target`` atomically (rename over the old link)."""
    link, target = Path(link), Path(target)
    tmp = link.with_name(link.name + ".linktmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(target, link.parent), tmp)
    fsync_dir(link.parent)
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def full_model_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on every rank (a collective for sharded models)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True would leave ranks other than 0 with an empty dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.detach().cpu() if cpu else v) for k, v in sd.items()}


# ---- consolidation -------------------------------------------------------------------------


def _strip_prefix(keys: list[str], prefix: Optional[str]) -> str:
    if prefix is not None:
        return prefix
    # auto: strip a leading component shared by every key (e.g. a LightningModule's "model.")
    out = ""
    while keys and all("." in k for k in keys):
        first = {k.split(".", 1)[0] for k in keys}
        if len(first) != 1:
            break
        head = first.pop() + "."
        out += head
        keys = [k[len(head):] for k in keys]
    return out


def consolidate(ckpt_dir: PathLike, out_file: PathLike, *, prefix: Optional[str] = None) -> Path:
    """Write the full model weights of a sharded checkpoint as one ``torch.save`` state dict.

    Runs in one process, without a process group. ``prefix`` is stripped from every key;
    ``None`` strips the leading components shared by all keys (``"model."`` of a
    LightningModule holding the GPT as ``self.model``); ``torch.compile``'s ``_orig_mod.``
    is always removed.
    """
    out = consolidated_state_dict(ckpt_dir, prefix=prefix)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    torch.save(out, tmp)
    fsync_file(tmp)
    os.replace(tmp, out_file)
    fsync_dir(out_file.parent)
    _write_hparams(consolidated_hparams_path(out_file), _saved_hparams(ckpt_dir))
    return out_file


def consolidated_hparams_path(out_file: PathLike) -> Path:
    """Where :func:`consolidate` keeps the hyper-parameters of ``out_file``: ``<out_file>.json``."""
    out_file = Path(out_file)
    return out_file.with_name(out_file.name + ".json")


def read_consolidated_hparams(out_file: PathLike) -> Optional[dict[str, Any]]:
    """The LightningModule hyper-parameters recorded beside a consolidated file (None: none recorded)."""
    path = consolidated_hparams_path(out_file)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}): re-run `lightning-perf consolidate`") from e
    hparams = data.get("hyper_parameters") if isinstance(data, dict) else None
    if not isinstance(hparams, dict):
        raise ValueError(f"{path} holds no 'hyper_parameters' object: re-run `lightning-perf consolidate`")
    return hparams


def _saved_hparams(ckpt_dir: PathLike) -> Optional[dict[str, Any]]:
    """Lightning's ``hyper_parameters`` in a checkpoint's ``extra`` (either layout), if any."""
    extra = read_extra(ckpt_dir).get("extra") or {}
    nested = extra.get("lightning") if isinstance(extra, dict) else None
    if isinstance(nested, dict) and len(extra) == 1:
        extra = nested
    hparams = extra.get("hyper_parameters") if isinstance(extra, dict) else None
    return dict(hparams) if isinstance(hparams, Mapping) and hparams else None


def _write_hparams(path: Path, hparams: Optional[dict[str, Any]]) -> None:
    if hparams is None:  # nothing to record: a file left by an earlier run must not describe these weights
        path.unlink(missing_ok=True)
        return
    # JSON keeps what rebuilds the module (numbers, strings, lists, the config dict); anything else is left out
    kept = {}
    for key, value in hparams.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"hyper_parameters": kept}, indent=2) + "\n")
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def consolidated_state_dict(ckpt_dir: PathLike, *, prefix: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, in memory (see :func:`consolidate`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_perf.parallel.checkpointing.checkpoint_io import SafeFileSystemReader, SafeLoadPlanner

    path = resolve(ckpt_dir)
    blob = read_extra(path)
    if "files" in blob:
        verify_files(path, blob["files"], local=True)
    else:
        _unverified(f"the files of {path} are not checked against their saved sizes and CRC-32 "
                    "(saved without a file manifest)")
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a DCP checkpoint (DeepSpeed-backend checkpoints use DeepSpeed's zero_to_fp32)")
    metadata = read_dcp_metadata(path)  # allow-listed unpickling: a planted object never runs
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            template[key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not template:
        raise ValueError(f"{path} holds no model tensors")
    try:
        dcp.load({"model": template}, storage_reader=SafeFileSystemReader(path, metadata),
                 planner=SafeLoadPlanner(path), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        unsafe = unsafe_error(e)
        if unsafe is not None:
            raise unsafe from e
        raise
    names = [k.replace("_orig_mod.", "") for k in template]
    strip = _strip_prefix(names, prefix)
    out: dict[str, torch.Tensor] = {}
    for key, name in zip(template, names):
        if not name.startswith(strip):
            raise ValueError(f"key {name!r} does not start with prefix {strip!r}")
        out[name[len(strip):]] = template[key]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``consolidate CKPT_DIR OUT_FILE`` (or ``--ckpt_dir D --out F``) ``[--prefix P]``."""
    parser = argparse.ArgumentParser(
        prog="lightning-perf consolidate",
        description="Merge a sharded (DCP) checkpoint into one state-dict file a plain model loads.",
    )
    parser.add_argument("ckpt", nargs="?", help="checkpoint directory written by the zero / 3D strategies")
    parser.add_argument("out_file", nargs="?", help="output file (torch.save'd state dict)")
    parser.add_argument("--ckpt_dir", "--ckpt-dir", dest="ckpt_flag", default=None, help="same as CKPT")
    parser.add_argument("--out", dest="out_flag", default=None, help="same as OUT_FILE")
    parser.add_argument("--prefix", default=None, help="key prefix to strip (default: auto, e.g. 'model.')")
    args = parser.parse_args(argv)
    ckpt_dir, out_file = args.ckpt_flag or args.ckpt, args.out_flag or args.out_file
    if ckpt_dir is None or out_file is None:
        parser.error("need a checkpoint directory and an output file")
    out = consolidate(ckpt_dir, out_file, prefix=args.prefix)
    n = len(torch.load(out, map_location="cpu", weights_only=True))
    hparams = consolidated_hparams_path(out)
    beside = f" and {hparams} (its hyper-parameters)" if hparams.is_file() else ""
    print(f"wrote {out} ({n} tensors){beside}")
    return 0
