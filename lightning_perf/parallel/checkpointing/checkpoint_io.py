"""What a checkpoint load trusts, and how a save reaches the disk.

**Loading: a checkpoint is data.** Three kinds of pickle live in a DCP checkpoint directory:

- ``.metadata``, which torch's own ``FileSystemReader`` reads with plain ``pickle.load``: here it is
  read by :class:`MetadataUnpickler`, whose ``find_class`` admits only the classes DCP writes there
  (:data:`METADATA_GLOBALS`: the dataclasses of ``torch.distributed.checkpoint.metadata``, the
  file-system reader's ``_StorageInfo``, ``torch.Size``, the ``torch`` dtypes, the layout helper
  ``torch.serialization._get_layout`` and ``pathlib`` paths). Anything else raises
  :class:`UnsafeCheckpointError` naming the file and the class before it is called, so nothing of a
  planted payload runs. The entries' file names must be plain names inside the checkpoint.
- non-tensor entries of the ``.distcp`` files, which torch's ``DefaultLoadPlanner`` reads with
  ``torch.load(weights_only=False)``: :class:`SafeLoadPlanner` reads them with ``weights_only=True``.
- tensor entries, which torch reads with ``torch.load(weights_only=True)`` already.

``extra.pt``, consolidated ``.pt`` files, Lightning ``.ckpt`` files and Hugging Face
``pytorch_model.bin`` files are read by :func:`torch_load_weights` (``weights_only=True``, a
refusal named as an :class:`UnsafeCheckpointError`).

**Saving: durable before visible.** :func:`fsync_file` and :func:`fsync_dir` flush a file's data
and a directory's entries to the device; the save sequence of
:mod:`lightning_perf.parallel.checkpointing.checkpoint` calls them so that every file of ``<ckpt>.tmp`` and the
directory itself are on disk before it is renamed into place, and the parent directory (the rename)
before an older checkpoint is deleted.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch

__all__ = [
    "CheckpointCorruptError",
    "METADATA_GLOBALS",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "fsync_dir",
    "fsync_file",
    "read_dcp_metadata",
    "torch_load_weights",
    "unsafe_error",
]

PathLike = Union[str, os.PathLike]
METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: ``(module, name)`` of every global a DCP ``.metadata`` written by torch 2.11 to 2.13 refers to
#: (plus the ``torch`` dtypes, see :func:`_allowed`). ``pathlib._local`` is where Python 3.13 keeps
#: the path classes; ``StorageMeta.checkpoint_id`` is the writer's ``Path``.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
    }
)


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, truncated or altered since it was saved (the message names it).

    Also ``lightning_perf.parallel.checkpointing.checkpoint.CheckpointCorruptError``, where the checkpoints are read."""


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file holds a pickled object outside what the format allows; nothing of it was run."""


def _allowed(module: str, name: str) -> Any:
    """The object ``module.name`` stands for if the allow-list admits it, else None (nothing imported)."""
    if (module, name) in METADATA_GLOBALS:
        if module.startswith("pathlib"):
            import pathlib

            return getattr(pathlib, name)
        return getattr(importlib.import_module(module), name)
    value = vars(torch).get(name) if module == "torch" else None  # no attribute hooks, no lazy imports
    if isinstance(value, torch.dtype):
        return value  # a dtype is a value: pickle refers to torch.float32 by name
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: only :data:`METADATA_GLOBALS` and the ``torch`` dtypes resolve."""

    def __init__(self, file: Any, *, source: PathLike) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self.source}: refused to unpickle {module}.{name}: a checkpoint's metadata holds only "
                "torch.distributed.checkpoint's metadata classes, so this file was altered or not written "
                "by a checkpoint save; nothing of it was run"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: refused a persistent id in a checkpoint's metadata")


def read_dcp_metadata(ckpt_dir: PathLike, *, rank: Optional[int] = None) -> Any:
    """The ``Metadata`` of the DCP checkpoint in ``ckpt_dir``, read through :class:`MetadataUnpickler`.

    ``rank``: a rank-local ``__<rank>.metadata`` instead. Raises :class:`UnsafeCheckpointError` for a
    refused class or a file name leading outside ``ckpt_dir``, and
    :class:`CheckpointCorruptError` for an unreadable file.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    file = Path(ckpt_dir) / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f, source=file).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, KeyError, AttributeError,
            IndexError, RuntimeError) as e:
        raise CheckpointCorruptError(f"{file} is unreadable (truncated or corrupted): {e}") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{file} holds a {type(metadata).__name__}, not a checkpoint's Metadata")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or Path(rel).name != rel or "\\" in rel:
            raise UnsafeCheckpointError(f"{file} names the data file {rel!r}, which is not a file of {ckpt_dir}")
    return metadata


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refused_global(err: BaseException) -> str:
    """The global torch's weights_only unpickler refused, as its message names it."""
    found = _GLOBAL.search(str(err))
    return found.group(1) if found else "an object weights_only loading does not admit"


def torch_load_weights(file: PathLike, **kwargs: Any) -> Any:
    """``torch.load(file, weights_only=True, **kwargs)``; a refused object raises
    :class:`UnsafeCheckpointError` naming the file and the class (nothing of it ran)."""
    try:
        return torch.load(file, weights_only=True, **kwargs)
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{file}: refused to unpickle {_refused_global(e)}: checkpoints are loaded with weights_only=True "
            "(tensors, numbers, strings and containers); nothing of it was run"
        ) from e


def _safe_classes() -> dict[str, type]:
    """The DCP reader and planner subclasses, defined on first use (DCP is imported only then)."""
    if _SAFE_CLASSES:
        return _SAFE_CLASSES
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """DCP's ``FileSystemReader`` with the metadata read by :func:`read_dcp_metadata`.

        ``metadata``: one already read (and checked) by the caller, used instead of reading it again.
        """

        def __init__(self, path: PathLike, metadata: Any = None) -> None:
            super().__init__(path)
            self._checked_metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            if rank is None and self._checked_metadata is not None:
                metadata = self._checked_metadata
            else:
                metadata = read_dcp_metadata(self.path, rank=rank)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's ``DefaultLoadPlanner`` reading non-tensor entries with ``torch.load(weights_only=True)``."""

        def __init__(self, source: PathLike = "", **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.source = source

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                data = getattr(getattr(self, "metadata", None), "storage_data", None) or {}
                info = data.get(read_item.storage_index)
                where = Path(self.source) / info.relative_path if info is not None else self.source
                raise UnsafeCheckpointError(
                    f"{where}: refused to unpickle {_refused_global(e)} in the entry {read_item.dest_index.fqn!r}: "
                    "non-tensor entries are loaded with weights_only=True; nothing of it was run"
                ) from e
            # hand the base class the same (plain) value to place in the state dict as it does
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    for cls in (SafeFileSystemReader, SafeLoadPlanner):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        _SAFE_CLASSES[cls.__name__] = cls
    return _SAFE_CLASSES


_SAFE_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # SafeFileSystemReader, SafeLoadPlanner: subclasses of DCP's, built when first asked for
    if name in ("SafeFileSystemReader", "SafeLoadPlanner"):
        return _safe_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unsafe_error(exc: BaseException) -> Optional[UnsafeCheckpointError]:
    """The :class:`UnsafeCheckpointError` behind ``exc`` (DCP gathers each rank's failure), or None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, UnsafeCheckpointError):
            return exc
        for failure in (getattr(exc, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, UnsafeCheckpointError):
                return inner
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


# ---- durability ------------------------------------------------------------------------------


def fsync_file(path: PathLike) -> None:
    """Flush ``path``'s data to the device (``os.fsync`` of a descriptor opened for it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Flush directory ``path``'s entries (files created or renamed in it) to the device.

    A no-op where directories cannot be opened (Windows).
    """
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
