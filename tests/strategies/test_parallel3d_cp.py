"""Context parallelism in Parallel3DStrategy (CPU processes, gloo) against one process.

The tiny Llama-style GPT of ``test_parallel3d`` (GQA, rotary positions) and a GPT-2-style one
(learned positions, tied head) train on the same 8 sequences of 16 tokens per step, 6 steps;
every layout must give the single-process losses (rtol 1e-4) and final parameters:

- 2 ranks: cp2 with ZeRO 2 (FSDP2 over the flattened dp x cp ranks) and forward-only validation,
  cp2 with ZeRO 0 (gradients all-reduced), cp2 of the GPT-2 shapes, a checkpoint saved under cp2
  and resumed under dp2; cp2 under selective activation checkpointing (ring and all-gather, ZeRO 2
  and 3) and under full checkpointing (the ring, its recomputation passing K / V again);
- 4 ranks: dp2 x cp2 (ZeRO 2 and ZeRO 0, and ZeRO 2 with ring attention), mesh coordinates and
  sampler ranks; cp2 x tp2 of both GPT shapes, and with ring attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _spawn import spawn
from test_parallel3d import PER_EPOCH, S, _check_run, fit


def _record_query_lengths() -> list[int]:
    """Patch (in this worker process) the cp attention to record each call's local query length."""
    from lightning_perf.parallel.model_parallel import context_parallel as cp

    seen: list[int] = []
    attention = cp.context_parallel_attention

    def recording(q, k, v, *, group):
        seen.append(q.shape[2])
        return attention(q, k, v, group=group)

    cp.context_parallel_attention = recording
    return seen


def _worker2(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    seen = _record_query_lengths()
    res["cp2"] = fit(S(context_parallel_size=2), world, val=True)
    res["cp2_query_lengths"] = sorted(set(seen))
    res["cp2_zero0"] = fit(S(context_parallel_size=2, zero_stage=0), world)
    res["cp2_gpt2"] = fit(S(context_parallel_size=2, zero_stage=3), world, kind="gpt2")
    ckpt = out / "cp2.ckpt"
    res["cp2_save"] = fit(S(context_parallel_size=2), world, steps=PER_EPOCH, save_to=ckpt)
    res["cp2_to_dp2"] = fit(S(data_parallel_size=2), world, dp=2, ckpt_path=ckpt)
    return res


def _worker4(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    strategy = S(context_parallel_size=2, zero_stage=2)
    res["dp2_cp2"] = fit(strategy, world, dp=2)
    mesh = strategy.device_mesh
    res["coords"] = {name: mesh[name].get_local_rank() for name in ("pp", "dp", "cp", "tp")}
    res["sampler"] = strategy.distributed_sampler_kwargs
    res["dp2_cp2_zero0"] = fit(S(context_parallel_size=2, zero_stage=0), world, dp=2)
    res["dp2_cp2_ring"] = fit(S(context_parallel_size=2, context_parallel_mode="ring"), world, dp=2)
    # tensor parallelism inside each cp rank: sequence parallelism splits its 8 tokens again over tp
    res["cp2_tp2"] = fit(S(context_parallel_size=2, tensor_parallel_size=2), world)
    res["cp2_tp2_gpt2"] = fit(S(context_parallel_size=2, tensor_parallel_size=2), world, kind="gpt2")
    res["cp2_tp2_ring"] = fit(S(context_parallel_size=2, tensor_parallel_size=2, context_parallel_mode="ring"), world)
    return res


def _worker2_checkpointing(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    for mode in ("ring", "allgather"):
        res[f"cp2_{mode}_selective"] = fit(S(context_parallel_size=2, context_parallel_mode=mode,
                                             activation_checkpointing="selective"), world)
    res["cp2_ring_selective_zero3"] = fit(S(context_parallel_size=2, context_parallel_mode="ring", zero_stage=3,
                                            activation_checkpointing="selective"), world)
    res["cp2_ring_full"] = fit(S(context_parallel_size=2, context_parallel_mode="ring",
                                 activation_checkpointing="full"), world)
    return res


@pytest.fixture(scope="module")
def references():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    def one(**kwargs: Any) -> dict:
        return fit(SingleDeviceStrategy(torch.device("cpu")), 1, **kwargs)

    return {"llama": one(val=True), "gpt2": one(kind="gpt2")}


@pytest.mark.slow
def test_cp2_layouts_and_resume(references, tmp_path) -> None:
    results = spawn(_worker2, 2, tmp_path, timeout=300.0)
    ref = references["llama"]
    for key in ("cp2", "cp2_zero0"):
        _check_run(results, key, ref)
    _check_run(results, "cp2_gpt2", references["gpt2"])
    for r in results:  # both cp ranks report the loss of the whole sequences
        assert r["cp2_query_lengths"] == [8]  # each rank attended from its 8 of the 16 tokens
        assert r["cp2"]["losses"] == results[0]["cp2"]["losses"]
        assert r["cp2"]["val"] == pytest.approx(ref["val"], rel=1e-4)
    losses = torch.tensor([r["cp2_save"]["losses"] for r in results]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"][:PER_EPOCH]), rtol=1e-4, atol=0)
    _check_run(results, "cp2_to_dp2", ref, first=PER_EPOCH)


@pytest.mark.slow
def test_cp2_under_activation_checkpointing(references, tmp_path) -> None:
    results = spawn(_worker2_checkpointing, 2, tmp_path, timeout=300.0)
    for key in ("cp2_ring_selective", "cp2_allgather_selective", "cp2_ring_selective_zero3", "cp2_ring_full"):
        _check_run(results, key, references["llama"])


@pytest.mark.slow
def test_dp2_cp2_and_cp2_tp2(references, tmp_path) -> None:
    results = spawn(_worker4, 4, tmp_path, timeout=300.0)
    ref = references["llama"]
    _check_run(results, "dp2_cp2", ref)
    _check_run(results, "dp2_cp2_zero0", ref)
    _check_run(results, "dp2_cp2_ring", ref)
    _check_run(results, "cp2_tp2", ref)
    _check_run(results, "cp2_tp2_gpt2", references["gpt2"])
    _check_run(results, "cp2_tp2_ring", ref)
    from lightning_perf.parallel.layout.dims import ParallelDims

    dims = ParallelDims(context_parallel_size=2, world_size=4)
    for rank, r in enumerate(results):
        assert r["coords"] == dims.coordinates(rank)
        # cp ranks of one replica load the same batches; the two replicas differ
        assert r["sampler"] == {"num_replicas": 2, "rank": dims.coordinates(rank)["dp"]}
    assert [dims.coordinates(r)["cp"] for r in range(4)] == [0, 1, 0, 1]
