"""``resolve_accumulation`` (the memory planner's hook), its verdict record, and the FSDP2 unit plan that
``FSDPAccumulation`` restores the units' resharding from."""

from __future__ import annotations

import pytest
import torch.nn as nn

from lightning_perf.parallel.sharding.accumulation import (
    AccumulationMemory,
    AccumulationQuery,
    FSDPAccumulation,
    accumulation_choices,
    resolve_accumulation,
)
from lightning_perf.parallel.sharding.fsdp import fsdp_unit_plan

GIB = 2**30


def _memory(capacity: int = 80 * GIB, **peaks: int) -> AccumulationMemory:
    return AccumulationMemory(peak_bytes=peaks, capacity_bytes=capacity)


def test_without_a_verdict_auto_is_reduce_once() -> None:
    for stage in (1, 2, 3):
        assert resolve_accumulation(8, stage=stage) == "reduce_once"
    assert resolve_accumulation(1) == "reduce_once"


def test_explicit_modes_are_kept() -> None:
    for mode in ("reduce_each", "reduce_once", "gather_once"):
        assert resolve_accumulation(8, mode=mode, stage=3) == mode
        assert resolve_accumulation(8, mode=mode, stage=3, verdict=_memory(reduce_each=1)) == mode
    # stage 1 has no sharded parameters to keep gathered
    assert resolve_accumulation(8, mode="gather_once", stage=1) == "reduce_once"


def test_deepspeed_resolves_to_what_its_engine_does() -> None:
    assert resolve_accumulation(8, stage=1, backend="deepspeed") == "reduce_once"
    for stage in (2, 3):
        assert resolve_accumulation(8, stage=stage, backend="deepspeed") == "reduce_each"
        with pytest.raises(ValueError, match="accumulates its own way"):
            resolve_accumulation(8, mode="gather_once", stage=stage, backend="deepspeed")


def test_the_verdict_picks_the_fewest_collectives_that_fit() -> None:
    peaks = {"gather_once": 70 * GIB, "reduce_once": 60 * GIB, "reduce_each": 50 * GIB}
    assert resolve_accumulation(8, verdict=_memory(80 * GIB, **peaks)) == "gather_once"
    assert resolve_accumulation(8, verdict=_memory(65 * GIB, **peaks)) == "reduce_once"
    assert resolve_accumulation(8, verdict=_memory(55 * GIB, **peaks)) == "reduce_each"
    # nothing fits: the least memory
    assert resolve_accumulation(8, verdict=_memory(40 * GIB, **peaks)) == "reduce_each"
    # a mode at exactly the capacity fits
    assert resolve_accumulation(8, verdict=_memory(70 * GIB, **peaks)) == "gather_once"
    # modes the verdict does not predict are never picked
    assert resolve_accumulation(8, verdict=_memory(80 * GIB, reduce_once=60 * GIB, reduce_each=50 * GIB)) \
        == "reduce_once"


def test_a_callable_verdict_is_asked_about_the_modes_that_differ() -> None:
    asked: list[AccumulationQuery] = []

    def planner(query: AccumulationQuery) -> AccumulationMemory:
        asked.append(query)
        return _memory(10 * GIB, **{m: 5 * GIB for m in query.modes})

    assert resolve_accumulation(8, stage=1, verdict=planner) == "reduce_once"
    assert resolve_accumulation(4, stage=2, verdict=planner) == "gather_once"
    assert asked == [AccumulationQuery(accumulate_grad_batches=8, stage=1, modes=("reduce_once", "reduce_each")),
                     AccumulationQuery(accumulate_grad_batches=4, stage=2,
                                       modes=("gather_once", "reduce_once", "reduce_each"))]
    # one micro-batch per step: every mode alike, the planner is not asked
    assert resolve_accumulation(1, verdict=planner) == "reduce_once" and len(asked) == 2
    assert accumulation_choices(3, "deepspeed") == ("reduce_each",)


def test_bad_verdicts_and_arguments() -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be an int > 0, got 0"):
        AccumulationMemory(peak_bytes={"reduce_once": 1}, capacity_bytes=0)
    with pytest.raises(ValueError, match=r"peak_bytes has modes \['auto'\]"):
        AccumulationMemory(peak_bytes={"auto": 1}, capacity_bytes=1)
    with pytest.raises(ValueError, match="peak_bytes must be ints >= 0"):
        AccumulationMemory(peak_bytes={"reduce_once": -1}, capacity_bytes=1)
    with pytest.raises(ValueError, match="predicts \\['gather_once'\\], none of the modes that differ at stage 1"):
        resolve_accumulation(8, stage=1, verdict=_memory(gather_once=1))
    with pytest.raises(TypeError, match="must be an AccumulationMemory, got dict"):
        resolve_accumulation(8, verdict=lambda query: {"reduce_once": 1})
    with pytest.raises(ValueError, match="accumulate_grad_batches must be an int >= 1, got 0"):
        resolve_accumulation(0)
    with pytest.raises(ValueError, match="accumulation='sometimes' is not one of"):
        resolve_accumulation(8, mode="sometimes")
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        FSDPAccumulation([], "auto")


def test_unit_plan_keeps_the_last_unit_and_the_root_gathered() -> None:
    root = nn.Module()
    root.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(5)] + [nn.ReLU()])  # the ReLU has no parameters
    blocks = list(root.blocks)
    plan = fsdp_unit_plan(root, blocks, reshard_after_forward=True, blocks_per_unit=2)
    assert [(u.modules, u.reshard_after_forward) for u in plan] == [
        (tuple(blocks[0:2]), True), (tuple(blocks[2:4]), True), ((blocks[4],), False), ((root,), False)]
    assert all(not u.reshard_after_forward for u in fsdp_unit_plan(root, blocks, reshard_after_forward=False))
    assert [(u.modules, u.reshard_after_forward) for u in fsdp_unit_plan(root, [], reshard_after_forward=True)] \
        == [((root,), True)]
