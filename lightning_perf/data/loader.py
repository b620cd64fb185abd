"""A data loader that can stop in the middle of an epoch and continue from the next sample.

Lightning saves and restores a training loader only if it has ``state_dict`` /
``load_state_dict`` (``CombinedLoader._state_dicts``, called from the fit loop's
``on_save_checkpoint``; restored in ``FitLoop.setup_data`` before the first
``iter()``). A plain ``torch.utils.data.DataLoader`` restarts the epoch on resume.

The order of an epoch is a pure function of ``(seed, epoch)``: a permutation of the
dataset indices (or ``0..N-1`` without shuffling). Data-parallel rank ``r`` of ``R``
takes positions ``r, r + R, r + 2R, ...`` of that global order. The only state is
the epoch and how many positions of the global order have been consumed, so a
resumed run continues with exactly the samples an uninterrupted run would have seen
(also with worker processes: indices are produced in the main process).

``ResumableDataLoader`` is deliberately not a ``DataLoader`` subclass: Lightning then
leaves it alone (it would otherwise replace the sampler by a ``DistributedSampler``
and re-instantiate the loader); sharding is done here from the strategy's
``distributed_sampler_kwargs``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ResumableDataLoader", "ResumableSampler"]

_STATE_VERSION = 1


class ResumableSampler(Sampler[int]):
    """Epoch-seeded order over ``num_samples`` indices, sharded by data-parallel rank,
    that can start at any position of the global order.

    Args:
        num_samples: size of the dataset.
        num_replicas: data-parallel world size ``R``.
        rank: this replica's data-parallel rank.
        shuffle: permute each epoch with a generator seeded by ``seed + epoch``.
        seed: base seed of the permutation.
    """

    def __init__(self, num_samples: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._next_start = 0

    @property
    def usable(self) -> int:
        """Length of the global order actually used: a multiple of ``num_replicas``
        so that every rank gets the same number of samples (the tail is dropped)."""
        return (self.num_samples // self.num_replicas) * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch."""
        self.epoch = epoch

    def start_next_iteration_at(self, position: int) -> None:
        """Make the next ``iter()`` (only that one) begin at ``position`` of the global order."""
        if not 0 <= position <= self.usable:
            raise ValueError(f"start position {position} is outside [0, {self.usable}]")
        self._next_start = position

    def global_order(self, epoch: int | None = None) -> np.ndarray:
        """All dataset indices in the order of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).numpy()

    def __len__(self) -> int:
        """Samples of a whole epoch on this rank."""
        return self.usable // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        start, self._next_start = self._next_start, 0
        order = self.global_order()
        count = (self.usable - start) // self.num_replicas
        # ints one at a time: a list of every index would cost ~30x the array's memory on big corpora
        return map(int, order[start + self.rank : start + count * self.num_replicas : self.num_replicas])


class ResumableDataLoader:
    """Batches of a map-style dataset in :class:`ResumableSampler` order, with
    ``state_dict`` / ``load_state_dict`` so Lightning resumes it mid-epoch.

    ``len()`` is always the number of batches of a whole epoch on this rank (what
    Lightning counts progress against); after ``load_state_dict`` the next iteration
    yields only the batches that were not consumed yet.

    Args:
        dataset: map-style dataset.
        batch_size: samples per batch on this rank.
        sampler: the order; its ``set_epoch`` is called by Lightning through ``.sampler``.
        drop_last: drop the last partial batch of an epoch.
        num_workers, pin_memory, persistent_workers, prefetch_factor, collate_fn,
            multiprocessing_context: passed to the ``torch.utils.data.DataLoader`` that
            does the loading.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        sampler: ResumableSampler,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        multiprocessing_context: Any = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) != sampler.num_samples:  # type: ignore[arg-type]
            raise ValueError(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")  # type: ignore[arg-type]
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self._loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            collate_fn=collate_fn,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        )
        # Lightning reads ``.batch_sampler`` (shuffle detection, DeepSpeed's micro-batch
        # size); it is the torch loader's BatchSampler over ``sampler``.
        self.batch_sampler = self._loader.batch_sampler
        self._epoch = sampler.epoch
        self._consumed = 0  # positions of the global order consumed in self._epoch
        self._pending: dict[str, Any] | None = None

    def __len__(self) -> int:
        per_rank = self.sampler.usable // self.sampler.num_replicas
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing runs until the first ``next()``. Lightning creates the
        # iterator before it calls ``set_epoch`` on a resumed run, so the epoch and
        # start position must be read lazily.
        sampler = self.sampler
        start = self._resume_position()
        self._epoch, self._consumed = sampler.epoch, start
        sampler.start_next_iteration_at(start)  # consumed by the torch loader's iter() just below
        step = self.batch_size * sampler.num_replicas
        for batch in self._loader:
            self._consumed = min(self._consumed + step, sampler.usable)
            yield batch

    def _resume_position(self) -> int:
        state, self._pending = self._pending, None
        if state is None or state["epoch"] != self.sampler.epoch:
            return 0
        start = int(state["consumed"])
        if start >= self.sampler.usable:
            return 0
        if start % (self.sampler.num_replicas * self.batch_size):
            warnings.warn(
                f"resuming at sample {start} of epoch {state['epoch']}, which is not a multiple of"
                f" batch_size({self.batch_size}) * num_replicas({self.sampler.num_replicas}): the batch size or"
                " the data-parallel size changed since the checkpoint; batches are re-cut from that sample on",
                stacklevel=3,
            )
        return start

    def state_dict(self) -> dict[str, Any]:
        """Epoch and number of samples of the global order consumed so far (all ranks)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "num_samples": self.sampler.num_samples,
            "shuffle": self.sampler.shuffle,
            "seed": self.sampler.seed,
            "num_replicas": self.sampler.num_replicas,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next iteration of the same epoch.

        Raises ``ValueError`` if the checkpoint was made over a different dataset
        (size), seed or shuffle setting: the saved position would mean other samples.
        """
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown loader state version {state_dict.get('version')!r} (expected {_STATE_VERSION})")
        mine = self.state_dict()
        for key in ("num_samples", "seed", "shuffle"):
            if state_dict[key] != mine[key]:
                raise ValueError(
                    f"cannot resume the data position: the checkpoint's loader has {key}={state_dict[key]!r}"
                    f" but this one has {key}={mine[key]!r} (same data, seed and shuffle are needed)"
                )
        self._pending = dict(state_dict)
        self._epoch, self._consumed = int(state_dict["epoch"]), int(state_dict["consumed"])

    def __repr__(self) -> str:
        s = self.sampler
        return (
            f"{type(self).__name__}(samples={s.num_samples}, batch_size={self.batch_size}, batches={len(self)},"
            f" rank={s.rank}/{s.num_replicas}, shuffle={s.shuffle}, num_workers={self.num_workers})"
        )
