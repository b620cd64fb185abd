"""Sharded checkpoints written in the background while training goes on.

The layout, manifest and atomic rename are those of :mod:`lightning_perf.parallel.checkpointing.checkpoint`;
only the timing differs:

1. ``save`` (collective) waits for the previous save to be final, prepares ``<ckpt>.tmp``, and
   *stages* this rank's shards (:class:`HostStager`): a copy in host memory, made before
   ``save`` returns, so the optimizer steps that follow cannot change what is written. Rank 0's
   ``extra`` is copied too. The ranks then agree that every one of them staged (a rank that could
   not fails the save on all of them, before anything is written).
2. The checkpointer's one writer thread writes the staged copy into ``<ckpt>.tmp`` with DCP's
   ``save`` and finalizes: the size/CRC-32 manifest (each rank checksums a share), rank 0's
   ``extra.pt``, and rank 0's rename of ``<ckpt>.tmp`` to ``<ckpt>``. Only then is the checkpoint
   visible.
3. ``poll`` (cheap: no collective, no wait) tells whether the save is final and raises its error if
   it failed; ``wait`` blocks until it is final. Removals of older checkpoints asked for while a
   save is in flight (``remove``) run once it is final, so the previous checkpoint survives a
   crash before then; if the save fails they never run. ``after_final`` defers any other action
   the same way (the pack's strategies move a ``last`` link with it: never onto a checkpoint that
   is not yet final).

The writer thread touches no accelerator: it writes host copies (DCP's writer is told to copy
nothing ahead from a device, so it never reads a CUDA stream), and it sets the rank's device before
anything else in case a later torch reaches for one. A thread that never set its device is on
device 0: the first CUDA call there would create a context on another rank's GPU, which fails with
"out of memory" when that GPU is full.

Host memory: by default each save stages into memory of its own, freed once written. ``reserve``
stages once, ahead of the first save, into buffers that every later save reuses (pageable memory:
pinning tens of GB would stall the step that reserves), when the host can hold them (see ``reserve``);
a save then allocates nothing, which is what a save at the moment of a preemption needs.

``save_now`` writes in the calling thread instead, on the same gloo group (no device memory for its
collectives): the way out when a background save failed (see ``PreemptionCheckpoint``).

The background collectives (DCP's plan and metadata exchange, the manifest, the rename's
barriers) use a gloo group of their own over the same ranks, created at construction: a group
shared with the training thread would interleave two threads' collectives. A step that fails on
one rank fails on every rank at the collective that ends it (DCP gathers its ranks' errors; the
finalize steps go through ``checkpoint.agreed``), so the others learn of it at once; a rank that
dies mid-write makes the others' collectives fail (or time out after the group's ``timeout``).
Either way ``<ckpt>.tmp`` is never renamed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from lightning_perf.parallel.checkpointing import checkpoint as ckpt

__all__ = ["AsyncCheckpointer", "AsyncCheckpointError", "HostStager", "async_save_supported", "host_memory_available",
           "staged_bytes"]

PathLike = Union[str, os.PathLike]

#: ``reserve`` keeps buffers only while every rank of the host together needs at most this share of its
#: available memory: the rest stays for the data loaders, the page cache of the writes, and the OS
RESERVE_SHARE = 0.5


class AsyncCheckpointError(RuntimeError):
    """A background save failed; its ``<ckpt>.tmp`` was not renamed and the previous checkpoint is intact."""


def async_save_supported() -> bool:
    """Whether this torch has DCP's state-dict copies and (in a process group) the gloo backend the saves
    coordinate on."""
    try:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict  # noqa: F401
    except ImportError:
        return False
    return not (dist.is_available() and dist.is_initialized()) or dist.is_gloo_available()


def host_memory_available() -> Optional[int]:
    """Bytes of host memory available to new allocations (Linux's ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def staged_bytes(state: Any) -> int:
    """Bytes a staged copy of ``state`` takes: every tensor's local storage once (a DTensor's own shard)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0

    def visit(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            local = x.to_local() if isinstance(x, DTensor) else x  # a DTensor stages its shard
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(state)
    return total


class HostStager:
    """Copies a state dict's tensors (a DTensor's local shard) into host memory it keeps for the next copy.

    Built on DCP's own state-dict utilities (``_create_cpu_state_dict`` makes host tensors of the same
    structure, DTensors included; ``_copy_state_dict`` fills them), which behave alike on every torch this
    pack supports. The buffers are pageable: pinning tens of GB would stall the step that allocates them for
    tens of seconds. Copies run in the calling thread, synchronously, so nothing is left in flight on a
    CUDA stream when the writer thread reads them.
    """

    def __init__(self) -> None:
        self._buffers: Optional[dict[str, Any]] = None
        self._layout: Optional[list[tuple[str, tuple[int, ...], torch.dtype]]] = None

    @staticmethod
    def _layout_of(state: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        out: list[tuple[str, tuple[int, ...], torch.dtype]] = []

        def visit(prefix: str, x: Any) -> None:
            if isinstance(x, torch.Tensor):
                local = x.to_local() if hasattr(x, "to_local") and hasattr(x, "device_mesh") else x
                out.append((prefix, tuple(local.shape), local.dtype))
            elif isinstance(x, dict):
                for k, v in x.items():
                    visit(f"{prefix}/{k}", v)
            elif isinstance(x, (list, tuple)):
                for i, v in enumerate(x):
                    visit(f"{prefix}/{i}", v)

        visit("", state)
        return out

    def allocate(self, state: dict[str, Any]) -> dict[str, Any]:
        """Host buffers of ``state``'s layout (the ones kept, where the layout is the same), not yet filled."""
        from torch.distributed._state_dict_utils import _create_cpu_state_dict

        layout = self._layout_of(state)
        if self._buffers is None or layout != self._layout:
            self._buffers, self._layout = _create_cpu_state_dict(state), layout
        return self._buffers

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state``; the buffers of the last call are reused when the layout is the same."""
        from torch.distributed._state_dict_utils import _copy_state_dict

        return _copy_state_dict(state, self.allocate(state), non_blocking=False)

    def close(self) -> None:
        self._buffers = self._layout = None


def _commit_pages(buffers: dict[str, Any]) -> None:
    """Write every host buffer once, so that its pages exist before a save copies into them."""
    from torch.distributed.tensor import DTensor

    def visit(x: Any) -> None:
        if isinstance(x, DTensor):
            x.to_local().zero_()
        elif isinstance(x, torch.Tensor):
            x.zero_()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(buffers)


def _bind_device(device: Optional[torch.device]) -> None:
    """The writer thread's first act: this rank's device, so that no call of it lands on another GPU."""
    if device is not None and device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)


class AsyncCheckpointer:
    """At most one save in flight; each written and finalized (manifest + rename) by one writer thread.

    Construct it on every rank at the same point (it creates a gloo process group over the world
    when a process group exists).

    Args:
        timeout: how long the background collectives wait for a rank before the save fails.
        device: this rank's device, which the writer thread sets before anything else (None: the
            current CUDA device of the constructing thread where CUDA is in use, else none).
    """

    def __init__(self, *, timeout: Optional[timedelta] = None, device: Optional[torch.device] = None) -> None:
        if not async_save_supported():
            raise RuntimeError(
                "asynchronous checkpoints need torch.distributed's state-dict copies (_state_dict_utils) and the gloo "
                "backend: use synchronous saves (async_checkpoint=False) with this torch build"
            )
        if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = None if device is None else torch.device(device)
        self._group: Optional[dist.ProcessGroup] = None
        if dist.is_available() and dist.is_initialized():
            kwargs: dict[str, Any] = {"backend": "gloo"}
            if timeout is not None:
                kwargs["timeout"] = timeout
            self._group = dist.new_group(**kwargs)
        self._rank = dist.get_rank() if self._group is not None else 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_perf_ckpt",
                                            initializer=_bind_device, initargs=(self.device,))
        self._reserved: Optional[HostStager] = None  # the stager whose buffers every save reuses (see reserve)
        self._committing: Optional[Future] = None  # the writer thread's fill of the reserved buffers
        self.reserved_bytes = 0
        self._pending: Optional[Future] = None
        self._pending_path: Optional[Path] = None
        # (the checkpoint it deletes, if any; the action), in the order asked for
        self._deferred: list[tuple[Optional[Path], Callable[[], None]]] = []
        self.finalized: list[Path] = []  # every checkpoint this process saw become final, in order

    @property
    def pending(self) -> Optional[Path]:
        """The checkpoint being written (not yet renamed into place), or None."""
        return self._pending_path

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The gloo group the saves coordinate on (None without a process group)."""
        return self._group

    def reserve(self, model: nn.Module, optimizers: Sequence[Optimizer] = (), *, ranks_on_host: int = 1) -> int:
        """Allocate host buffers of the state's layout that every later save stages into; the bytes kept (0: none).

        The buffers are allocated here and their pages committed by the writer thread while training goes on
        (a save waits for that), so the step that reserves is not held up by tens of GB of copies.

        Not collective. Kept only while ``ranks_on_host`` ranks with as much each need at most
        ``RESERVE_SHARE`` of the host's available memory; otherwise saves keep staging into memory of
        their own (freed once written) and this returns 0. Call it once the optimizer has state
        (after the first step): what it does not hold yet is allocated by the save that first has it.
        """
        self.wait()
        state, _ = ckpt.sharded_state(model, optimizers)
        need = staged_bytes(state)
        available = host_memory_available()
        if available is None or need * max(1, ranks_on_host) > RESERVE_SHARE * available:
            self._release()
            return 0
        if self._reserved is None:
            self._reserved = HostStager()
        buffers = self._reserved.allocate(state)  # no copy: the training step that reserves is not held up
        # the writer thread commits the pages (a fill of every buffer) while training goes on; a save waits
        # for it before staging into them
        self._committing = self._executor.submit(_commit_pages, buffers)
        self.reserved_bytes = need
        return need

    def _committed(self) -> None:
        """Wait for the writer thread's commit of the reserved buffers' pages, if one is under way."""
        if self._committing is not None:
            self._committing.result()
            self._committing = None

    def _release(self) -> None:
        self._committed()
        if self._reserved is not None:
            self._reserved.close()
        self._reserved, self.reserved_bytes = None, 0

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

        Returns once the state is copied; the future completes when ``path`` is final. A rank that
        cannot stage fails the save on every rank (``checkpoint.CheckpointSaveError``), before
        anything is written.
        """
        self.wait()
        path = Path(path)
        self._deferred = [(p, a) for p, a in self._deferred if p != path]  # a new save of it cancels its removal
        tmp = ckpt.prepare_tmp(path, group=self._group)
        self._committed()  # the reserved buffers' pages, committed in the background
        stager = self._reserved if self._reserved is not None else HostStager()

        def stage() -> tuple[Any, dict[str, Any]]:
            state, blob = ckpt.sharded_state(model, optimizers, extra)
            return stager.stage(state), copy.deepcopy(blob)  # loop counters, callback states: as they are now

        try:
            staged, blob = ckpt.agreed(f"staging checkpoint {path} in host memory", stage, group=self._group)
        except BaseException:
            if stager is not self._reserved:
                stager.close()
            raise
        own = None if stager is self._reserved else stager
        self._pending_path = path
        self._pending = self._executor.submit(self._write, staged, own, tmp, path, blob, checksum)
        return self._pending

    def _write(self, staged: dict[str, Any], stager: Optional[Any], tmp: Path, path: Path, blob: dict[str, Any],
               checksum: bool) -> Path:
        """The writer thread: the staged shards into ``tmp`` (DCP), then the manifest and the rename."""
        try:
            ckpt.write_shards(staged, tmp, group=self._group, from_host=True)
        finally:
            del staged
            if stager is not None:  # a save's own staging memory goes once written
                stager.close()
        ckpt.finish_save(tmp, path, blob, checksum=checksum, group=self._group)
        return path

    def save_now(
        self,
        path: PathLike,
        model: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        extra: Optional[dict[str, Any]] = None,
        *,
        checksum: bool = True,
    ) -> Path:
        """Write ``path`` in the calling thread, on this checkpointer's gloo group (collective).

        Waits for the save in flight first (raising its error, if any). The device's shards are
        copied to the host as they are written: no staging memory, no writer thread.
        """
        self.wait()
        return ckpt.save_checkpoint(path, model, optimizers, extra=extra, group=self._group, checksum=checksum)

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
        """Wait for the save in flight, stop the writer thread and free the reserved buffers."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._release()

