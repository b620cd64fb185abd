"""Sharded checkpoints written in the background while training goes on (DCP ``async_save``).

The layout, manifest and atomic rename are those of :mod:`lightning_perf.parallel.checkpointing.checkpoint`;
only the timing differs:

1. ``save`` (collective) waits for the previous save to be final, prepares ``<ckpt>.tmp``, and
   *stages* this rank's shards: ``async_save`` copies them to host memory before returning, so
   the optimizer steps that follow cannot change what is written. Rank 0's ``extra`` is copied
   too.
2. A background thread on every rank writes the staged shards into ``<ckpt>.tmp``, then
   finalizes: the size/CRC-32 manifest (each rank checksums a share), rank 0's ``extra.pt``, and
   rank 0's rename of ``<ckpt>.tmp`` to ``<ckpt>``. Only then is the checkpoint visible.
3. ``poll`` (cheap: no collective, no wait) tells whether the save is final and raises its error if
   it failed; ``wait`` blocks until it is final. Removals of older checkpoints asked for while a
   save is in flight (``remove``) run once it is final, so the previous checkpoint survives a
   crash before then; if the save fails they never run. ``after_final`` defers any other action
   the same way (the pack's strategies move a ``last`` link with it: never onto a checkpoint that
   is not yet final).

The background collectives (DCP's plan and metadata exchange, the manifest, the rename's
barriers) use a gloo group of their own over the same ranks, created at construction: DCP's
asynchronous save needs a CPU backend, and a group shared with the training thread would
interleave two threads' collectives. A rank that dies mid-write makes the others' background
collectives fail (or time out after the group's ``timeout``), so ``<ckpt>.tmp`` is never renamed.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from lightning_perf.parallel.checkpointing import checkpoint as ckpt

__all__ = ["AsyncCheckpointer", "AsyncCheckpointError", "async_save_supported"]

PathLike = Union[str, os.PathLike]


class AsyncCheckpointError(RuntimeError):
    """A background save failed; its ``<ckpt>.tmp`` was not renamed and the previous checkpoint is intact."""


def async_save_supported() -> bool:
    """Whether this torch has DCP's ``async_save`` and (in a process group) the gloo backend it coordinates on."""
    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "async_save"):
        return False
    return not (dist.is_available() and dist.is_initialized()) or dist.is_gloo_available()


class AsyncCheckpointer:
    """At most one save in flight; each finalized (manifest + rename) by a background thread.

    Construct it on every rank at the same point (it creates a gloo process group over the world
    when a process group exists). ``timeout``: how long the background collectives wait for a
    rank before the save fails.
    """

    def __init__(self, *, timeout: Optional[timedelta] = None) -> None:
        if not async_save_supported():
            raise RuntimeError(
                "asynchronous checkpoints need torch.distributed.checkpoint.async_save and the gloo "
                "backend: use synchronous saves (async_checkpoint=False) with this torch build"
            )
        self._group: Optional[dist.ProcessGroup] = None
        if dist.is_available() and dist.is_initialized():
            kwargs: dict[str, Any] = {"backend": "gloo"}
            if timeout is not None:
                kwargs["timeout"] = timeout
            self._group = dist.new_group(**kwargs)
        self._rank = dist.get_rank() if self._group is not None else 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_perf_ckpt")
        self._pending: Optional[Future] = None
        self._pending_path: Optional[Path] = None
        # (the checkpoint it deletes, if any; the action), in the order asked for
        self._deferred: list[tuple[Optional[Path], Callable[[], None]]] = []
        self.finalized: list[Path] = []  # every checkpoint this process saw become final, in order

    @property
    def pending(self) -> Optional[Path]:
        """The checkpoint being written (not yet renamed into place), or None."""
        return self._pending_path

    def save(
        self,
        path: PathLike,
        model: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        extra: Optional[dict[str, Any]] = None,
        *,
        checksum: bool = True,
    ) -> Future:
        """Stage this rank's shards and write them to ``path`` in the background (collective).

        Returns once the state is copied; the future completes when ``path`` is final.
        """
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = Path(path)
        self._deferred = [(p, a) for p, a in self._deferred if p != path]  # a new save of it cancels its removal
        tmp = ckpt.prepare_tmp(path, group=self._group)
        state, blob = ckpt.sharded_state(model, optimizers, extra)
        blob = copy.deepcopy(blob)  # loop counters, callback states: as they are now
        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp)}
        if self._group is not None:
            kwargs["process_group"] = self._group
        elif "no_dist" in inspect.signature(dcp.async_save).parameters:
            kwargs["no_dist"] = True
        written = dcp.async_save(state, **kwargs)  # staged (copied to host memory) on return
        written = getattr(written, "upload_completion", written)  # torch's zero-overhead response type
        del state
        self._pending_path = path
        self._pending = self._executor.submit(self._finalize, written, tmp, path, blob, checksum)
        return self._pending

    def _finalize(self, written: Future, tmp: Path, path: Path, blob: dict[str, Any], checksum: bool) -> Path:
        written.result()  # every rank's shards and DCP's .metadata are in tmp
        ckpt.finish_save(tmp, path, blob, checksum=checksum, group=self._group)
        return path

    def poll(self) -> bool:
        """True when no save is in flight (the last one is final; deferred removals done). Never blocks."""
        if self._pending is None:
            return True
        if not self._pending.done():
            return False
        self._collect()
        return True

    def wait(self) -> Optional[Path]:
        """Block until the save in flight is final; returns its path.

        None when no save is in flight, including one that ``poll`` or ``remove`` already found
        final: ``finalized`` lists every checkpoint that became final, whichever call saw it.
        """
        if self._pending is None:
            return None
        self._pending.exception()  # blocks until done; the error, if any, is raised by _collect
        return self._collect()

    def remove(self, path: PathLike) -> None:
        """Remove checkpoint ``path`` (on rank 0) now, or once the save in flight is final."""
        path = Path(path)
        self.after_final(lambda: self._remove_now(path), removes=path)

    def _remove_now(self, path: Path) -> None:
        if self._rank == 0:
            ckpt.remove(path)

    def after_final(self, action: Callable[[], None], *, removes: Optional[PathLike] = None) -> None:
        """Run ``action`` on this rank once the save in flight is final (now if none is); never if it fails.

        Deferred actions run in the order they were asked for. ``removes``: the checkpoint the action
        deletes, so that a later save to that path cancels it.
        """
        if self._pending is not None and not self.poll():
            self._deferred.append((None if removes is None else Path(removes), action))
        else:
            action()

    def _collect(self) -> Path:
        future, path = self._pending, self._pending_path
        assert future is not None and path is not None
        self._pending = self._pending_path = None
        deferred, self._deferred = self._deferred, []
        error = future.exception()
        if error is not None:  # the deferred removals (and links) are dropped: the older checkpoints stay
            raise AsyncCheckpointError(
                f"writing checkpoint {path} failed in the background ({type(error).__name__}: {error}); "
                f"{path.name}.tmp was not renamed, the previous checkpoints are intact"
            ) from error
        self.finalized.append(path)
        for _, action in deferred:
            action()
        return path

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
