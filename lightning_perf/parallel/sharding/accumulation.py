"""Gradient accumulation under ZeRO: how often parameters are gathered and gradients reduced.

With ``accumulate_grad_batches = k``, one optimizer step runs k micro-batches. The mode says what the
k micro-batches cost in collectives and memory:

=============  =====================================================  ==================================
mode           per optimizer step, per FSDP2 unit (stage 3)           held between micro-batches
=============  =====================================================  ==================================
reduce_each    k x (all-gather in forward, again in backward),        sharded gradients only (least
               k reduce-scatters                                      memory)
reduce_once    k x (all-gather in forward, again in backward),        unsharded gradients (in FSDP2's
               1 reduce-scatter, after the last micro-batch           reduce dtype)
gather_once    1 all-gather (the first forward), 1 reduce-scatter     unsharded gradients and the
                                                                      unsharded parameters
=============  =====================================================  ==================================

At stage 2 (parameters gathered from forward to backward) each micro-batch gathers once instead of
twice under ``reduce_each`` / ``reduce_once``. At stage 1 (DDP, parameters never sharded)
``reduce_each`` all-reduces every micro-batch and ``reduce_once`` (= ``gather_once``) skips the
all-reduce (``no_sync``) on all but the last. DeepSpeed's engine decides for itself: stage 1
reduces once per step, stages 2 and 3 on every micro-batch (:func:`deepspeed_accumulation`).

``"auto"`` is settled by :func:`resolve_accumulation` before training: without a memory verdict it
is ``reduce_once``; with one (an :class:`AccumulationMemory`, or a callable that answers an
:class:`AccumulationQuery` with one) it is the mode with the fewest collectives whose predicted
peak fits the device.

:class:`FSDPAccumulation` switches FSDP2's units for one mode around each micro-batch.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union

import torch.nn as nn

from lightning_perf.parallel.sharding.fsdp import FSDPUnit

__all__ = [
    "ACCUMULATION_MODES",
    "AccumulationMemory",
    "AccumulationMode",
    "AccumulationQuery",
    "FSDPAccumulation",
    "MemoryVerdict",
    "accumulation_choices",
    "check_accumulation",
    "deepspeed_accumulation",
    "resolve_accumulation",
]

AccumulationMode = Literal["auto", "reduce_each", "reduce_once", "gather_once"]
ACCUMULATION_MODES = ("auto", "reduce_each", "reduce_once", "gather_once")
_CONCRETE = ACCUMULATION_MODES[1:]
_DEFAULT = "reduce_once"  # without a memory verdict: gradients reduced once a step, parameters gathered per micro-batch


def deepspeed_accumulation(stage: int) -> str:
    """What DeepSpeed's engine does between its steps: ZeRO-1 reduces at the accumulation boundary only,
    ZeRO-2/3 reduce (into their gradient partitions) during every backward."""
    return "reduce_once" if stage == 1 else "reduce_each"


def accumulation_choices(stage: int, backend: str = "native") -> tuple[str, ...]:
    """The modes that differ at ``stage`` on ``backend``, fewest collectives first."""
    if backend == "deepspeed":
        return (deepspeed_accumulation(stage),)
    if stage == 1:  # parameters are never sharded: gather_once is reduce_once
        return ("reduce_once", "reduce_each")
    return ("gather_once", "reduce_once", "reduce_each")


def check_accumulation(mode: object, *, stage: int, backend: str) -> None:
    """Raise ValueError for a mode that is not one of :data:`ACCUMULATION_MODES` or that ``backend`` cannot run."""
    if mode not in ACCUMULATION_MODES:
        raise ValueError(f"accumulation={mode!r} is not one of {ACCUMULATION_MODES}")
    if backend == "deepspeed" and mode != "auto" and mode != deepspeed_accumulation(stage):
        does = deepspeed_accumulation(stage)
        raise ValueError(
            f"backend='deepspeed' at stage {stage} accumulates its own way ({does!r}: "
            + ("gradients reduced once, at the last micro-batch" if does == "reduce_once"
               else "gradients reduced into their partitions on every micro-batch")
            + f"), so accumulation={mode!r} cannot be honoured: pass accumulation='auto' or {does!r}, "
            "or use backend='native'")


@dataclass(frozen=True, kw_only=True)
class AccumulationQuery:
    """What a memory planner is asked: the peak of each of ``modes`` for this run."""

    accumulate_grad_batches: int
    stage: int
    modes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class AccumulationMemory:
    """A memory planner's verdict: the predicted peak bytes per device of each mode it considered, and
    the bytes the device has for training (``capacity_bytes``, after whatever headroom it keeps)."""

    peak_bytes: Mapping[str, int] = field(default_factory=dict)
    capacity_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) \
                or self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {self.capacity_bytes!r}")
        unknown = sorted(set(self.peak_bytes) - set(_CONCRETE))
        if unknown:
            raise ValueError(f"peak_bytes has modes {unknown}: predict some of {_CONCRETE}")
        bad = {m: b for m, b in self.peak_bytes.items()
               if isinstance(b, bool) or not isinstance(b, int) or b < 0}
        if bad:
            raise ValueError(f"peak_bytes must be ints >= 0, got {bad}")

    def fits(self, mode: str) -> bool:
        return mode in self.peak_bytes and self.peak_bytes[mode] <= self.capacity_bytes


#: what :func:`resolve_accumulation` takes from a memory planner: its verdict, or how to get it
MemoryVerdict = Union[AccumulationMemory, Callable[[AccumulationQuery], AccumulationMemory]]


def resolve_accumulation(accumulate_grad_batches: int, *, mode: str = "auto", stage: int = 3,
                         backend: str = "native", verdict: Optional[MemoryVerdict] = None) -> str:
    """The concrete mode a run accumulates with (``"reduce_each"``, ``"reduce_once"`` or ``"gather_once"``).

    Args:
        accumulate_grad_batches: micro-batches per optimizer step (1: no accumulation, every mode alike).
        mode: the requested mode; anything but ``"auto"`` is kept (``"gather_once"`` at stage 1 is
            ``"reduce_once"``: there are no sharded parameters to keep gathered).
        stage, backend: the ZeRO stage and backend (DeepSpeed's engine has a mode of its own).
        verdict: the memory planner's hook, read only for ``"auto"`` with more than one micro-batch:
            an :class:`AccumulationMemory`, or a callable given an :class:`AccumulationQuery` (the modes
            that differ here, fewest collectives first) that returns one. The first of those modes whose
            predicted peak is at most ``capacity_bytes`` wins; if none fits, the one with the lowest
            predicted peak. ``None``: ``"reduce_once"``.
    """
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int) \
            or accumulate_grad_batches < 1:
        raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
    check_accumulation(mode, stage=stage, backend=backend)
    choices = accumulation_choices(stage, backend)
    if mode != "auto":
        return "reduce_once" if mode == "gather_once" and stage == 1 else mode
    if len(choices) == 1:
        return choices[0]
    if verdict is None or accumulate_grad_batches == 1:
        return _DEFAULT
    memory = verdict(AccumulationQuery(accumulate_grad_batches=accumulate_grad_batches, stage=stage,
                                       modes=choices)) if callable(verdict) else verdict
    if not isinstance(memory, AccumulationMemory):
        raise TypeError(f"the accumulation memory verdict must be an AccumulationMemory, got {type(memory).__name__}")
    predicted = [m for m in choices if m in memory.peak_bytes]
    if not predicted:
        raise ValueError(f"the memory verdict predicts {sorted(memory.peak_bytes)}, none of the modes that differ "
                         f"at stage {stage}: {choices}; predict their peaks or pass accumulation= explicitly")
    for m in predicted:
        if memory.fits(m):
            return m
    return min(predicted, key=lambda m: memory.peak_bytes[m])


class FSDPAccumulation:
    """FSDP2's switches for one accumulation mode, set around each micro-batch of an optimizer step.

    Wrap each non-final micro-batch (forward and backward) in :meth:`deferred` and call
    :meth:`after_backward` after every backward:

    - ``reduce_each``: nothing changes, every backward reduce-scatters;
    - ``reduce_once``: gradient sync off in :meth:`deferred` (FSDP2 accumulates unsharded gradients);
    - ``gather_once``: in :meth:`deferred` also no resharding after forward or backward, so the first
      micro-batch's all-gather serves them all. Leaving it, resharding after backward comes back (the
      last backward reshards, so the optimizer steps the sharded parameters and the next step gathers
      the new values) while resharding after forward stays off through the last micro-batch (its
      backward needs no gather); the last :meth:`after_backward` restores each unit's own setting.

    Args:
        units: the FSDP2 units of the model and their ``reshard_after_forward``
            (``parallel.sharding.fsdp.fsdp_unit_plan``).
        mode: a concrete mode (:func:`resolve_accumulation`).
    """

    def __init__(self, units: Sequence[FSDPUnit], mode: str) -> None:
        if mode not in _CONCRETE:
            raise ValueError(f"mode must be one of {_CONCRETE} (resolve 'auto' first), got {mode!r}")
        # one module per unit: the modules of a group of blocks share one FSDP state
        self._units: list[tuple[nn.Module, bool]] = [(u.modules[0], u.reshard_after_forward) for u in units]
        self.mode = mode
        self._deferring = False
        self._held = False  # gather_once: units keep their parameters gathered until the step's last backward

    @property
    def holds_parameters(self) -> bool:
        """Whether parameters stay gathered across micro-batches now (between a step's first and last backward)."""
        return self._held

    @contextmanager
    def deferred(self) -> Generator[None, None, None]:
        """Around a non-final micro-batch: no gradient reduction (and, for ``gather_once``, no resharding)."""
        if self.mode == "reduce_each":
            yield None
            return
        gather_once = self.mode == "gather_once"
        for unit, _ in self._units:
            unit.set_requires_gradient_sync(False, recurse=False)
            if gather_once:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.set_reshard_after_backward(False, recurse=False)
        self._held = self._held or gather_once
        self._deferring = True
        try:
            yield None
        finally:
            self._deferring = False
            for unit, _ in self._units:
                unit.set_requires_gradient_sync(True, recurse=False)
                if gather_once:
                    unit.set_reshard_after_backward(True, recurse=False)

    def after_backward(self) -> None:
        """After every backward: the step's last one (outside :meth:`deferred`) has reduce-scattered and
        resharded; the units go back to their own resharding after forward for the next step."""
        if self._held and not self._deferring:
            self._restore()

    def release(self) -> None:
        """Reshard parameters held gathered between micro-batches (before a checkpoint reads or writes the
        sharded parameters); the accumulated gradients stay, the next micro-batch gathers again."""
        if self._held:
            for unit, _ in self._units:
                unit.reshard()

    def finish(self) -> None:
        """End of training: nothing held gathered, every unit back to its own settings."""
        self.release()
        if self._held:
            self._restore()
        for unit, _ in self._units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)

    def _restore(self) -> None:
        for unit, reshard in self._units:
            unit.set_reshard_after_forward(reshard, recurse=False)
        self._held = False
