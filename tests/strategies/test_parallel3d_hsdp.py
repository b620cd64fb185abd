"""HSDP over the dp dimension of Parallel3DStrategy (CPU processes, gloo) against one process.

The tiny Llama-style GPT of ``test_parallel3d`` trains on the same 8 sequences per step; each
layout must give the single-process losses (rtol 1e-4) and parameters:

- replicate 2 x shard 2 (ZeRO 3) for one epoch, the mesh's coordinates and sampler ranks, its
  sharded checkpoint resumed under dp4 without replication for the second epoch;
- beside tensor, pipeline and context parallelism, one epoch each: tp2 x (replicate 2 x shard 1),
  pp2 x (replicate 2 x shard 1) and (replicate 2 x shard 1) x cp2, FSDP2 sharding over the cp ranks;
- ``replicate_size="auto"`` launched as a cluster would, two "nodes" of two processes
  (``_parallel3d_nodes.py``, ``Trainer(num_nodes=2, devices=2)``), one epoch each: dp4 as
  replicate 2 x shard 2 and tp2 x dp2 as replicate 2 x shard 1, replicas across the nodes and
  shards (or tp ranks) within one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _spawn import launch_nodes, spawn
from test_parallel3d import PER_EPOCH, S, _check_run, fit

HERE = Path(__file__).resolve().parent


def _hsdp_worker(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    strategy = S(replicate_size=2, zero_stage=3)
    ckpt = out / "hsdp.ckpt"
    res["hsdp"] = fit(strategy, world, dp=4, steps=PER_EPOCH, save_to=ckpt)
    mesh = strategy.device_mesh
    res["names"] = mesh.mesh_dim_names
    res["coords"] = {n: mesh[n].get_local_rank() for n in ("pp", "dp_replicate", "dp_shard", "dp", "cp", "tp")}
    res["groups"] = {n: mesh[n].mesh.tolist() for n in ("dp_replicate", "dp_shard", "dp")}
    res["sampler"] = strategy.distributed_sampler_kwargs
    params = list(strategy.lightning_module.parameters())
    res["layouts"] = {(p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) for p in params}
    res["local_numel"] = sum(p.to_local().numel() for p in params)
    res["hsdp_to_dp4"] = fit(S(data_parallel_size=4, zero_stage=2), world, dp=4, ckpt_path=ckpt)
    return res


def _composition_worker(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    for key, kwargs in (("tp2_hsdp", {"tensor_parallel_size": 2}), ("pp2_hsdp", {"pipeline_parallel_size": 2}),
                        ("cp2_hsdp", {"context_parallel_size": 2})):
        strategy = S(replicate_size=2, zero_stage=2, **kwargs)
        res[key] = fit(strategy, world, dp=2, steps=PER_EPOCH)
        # FSDP2's mesh: the shard dimension is "dp_shard", or "dp_shard_cp" (the cp ranks) under context parallelism
        res[key]["fsdp_mesh"] = {p.device_mesh.mesh_dim_names[:2] for p in strategy.lightning_module.parameters()}
    return res


def _one_process(**kwargs: Any) -> dict:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return fit(SingleDeviceStrategy(torch.device("cpu")), 1, **kwargs)


@pytest.fixture(scope="module")
def first_epoch() -> dict:
    return _one_process(steps=PER_EPOCH)


@pytest.fixture(scope="module")
def reference(first_epoch) -> dict:
    return {"full": _one_process(), "first_epoch": first_epoch}


@pytest.mark.slow
def test_replicate2_shard2_equals_one_process_and_resumes_without_hsdp(reference, tmp_path) -> None:
    results = spawn(_hsdp_worker, 4, tmp_path, timeout=300.0)
    _check_run(results, "hsdp", reference["first_epoch"])
    _check_run(results, "hsdp_to_dp4", reference["full"], first=PER_EPOCH)
    from lightning_perf.parallel.layout.dims import ParallelDims

    dims = ParallelDims(replicate_size=2, world_size=4)
    for rank, r in enumerate(results):
        assert r["names"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert r["coords"] == {"pp": 0, "cp": 0, "tp": 0, "dp_replicate": rank // 2, "dp_shard": rank % 2,
                               "dp": rank} == dims.coordinates(rank)
        # shard groups are neighbouring ranks (one node), replicas the same shard of each group
        assert r["groups"] == {"dp_replicate": [rank % 2, rank % 2 + 2], "dp_shard": [rank - rank % 2, rank - rank % 2 + 1],
                               "dp": [0, 1, 2, 3]}
        assert r["sampler"] == {"num_replicas": 4, "rank": rank}  # every dp rank loads its own part
        # FSDP2 on the 2-D mesh: replicated over dp_replicate, each rank holding half the model, not a quarter
        assert r["layouts"] == {(("dp_replicate", "dp_shard"), ("R", "S(0)"))}
    n = sum(v.numel() for v in reference["first_epoch"]["final"].values())
    assert all(abs(r["local_numel"] - n / 2) <= 64 for r in results), (n, [r["local_numel"] for r in results])


@pytest.mark.slow
def test_hsdp_beside_tensor_pipeline_and_context_parallelism(reference, tmp_path) -> None:
    results = spawn(_composition_worker, 4, tmp_path, timeout=300.0)
    for key in ("tp2_hsdp", "pp2_hsdp", "cp2_hsdp"):
        _check_run(results, key, reference["first_epoch"])
    for r in results:
        assert r["tp2_hsdp"]["fsdp_mesh"] == r["pp2_hsdp"]["fsdp_mesh"] == {("dp_replicate", "dp_shard")}
        assert r["cp2_hsdp"]["fsdp_mesh"] == {("dp_replicate", "dp_shard_cp")}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> list[dict]:
    from _parallel3d_nodes import DEVICES, NODES

    return launch_nodes(HERE / "_parallel3d_nodes.py", tmp_path_factory.mktemp("nodes"), nodes=NODES, devices=DEVICES)


def test_auto_replicates_across_nodes_and_shards_within_one(two_nodes) -> None:
    from lightning_perf.parallel.layout.dims import ParallelDims

    for rank, r in enumerate(two_nodes):
        node, local = r["node_rank"], rank % 2
        hsdp, tp2 = r["hsdp"], r["tp2_hsdp"]
        assert hsdp["global_rank"] == tp2["global_rank"] == 2 * node + local and hsdp["world_size"] == 4
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        # dp4: a replica per node, each node's two processes sharding it
        assert hsdp["names"] == names and hsdp["shape"] == (1, 2, 2, 1, 1)
        dims = ParallelDims(replicate_size="auto", num_nodes=2, world_size=4)
        assert hsdp["coords"] == {"pp": 0, "dp_replicate": node, "dp_shard": local, "dp": rank, "cp": 0, "tp": 0} \
            == dims.coordinates(rank)
        assert hsdp["groups"]["dp_shard"] == [2 * node, 2 * node + 1]  # the node's processes
        assert hsdp["groups"]["dp_replicate"] == [local, local + 2]  # the same shard on each node
        assert hsdp["sampler"] == {"num_replicas": 4, "rank": rank}
        assert hsdp["params"] == {(("dp_replicate", "dp_shard"), ("R", "S(0)"))}
        # tp2 x dp2: the tp ranks are a node's processes, the dp replicas one per node
        assert tp2["names"] == names and tp2["shape"] == (1, 2, 1, 1, 2)
        dims = ParallelDims(tensor_parallel_size=2, replicate_size="auto", num_nodes=2, world_size=4)
        assert tp2["coords"] == {"pp": 0, "dp_replicate": node, "dp_shard": 0, "dp": node, "cp": 0, "tp": local} \
            == dims.coordinates(rank)
        assert tp2["groups"]["tp"] == [2 * node, 2 * node + 1] and tp2["groups"]["dp_shard"] == [rank]
        assert tp2["groups"]["dp_replicate"] == tp2["groups"]["dp"] == [local, local + 2]
        assert tp2["sampler"] == {"num_replicas": 2, "rank": node}  # a node's tp ranks load the same rows
        # FSDP2 x TP: replicated across the nodes, the projections split over a node's tp ranks
        assert {mesh for mesh, _ in tp2["params"]} == {("dp_replicate", "dp_shard", "tp")}
        assert {placements[0] for _, placements in tp2["params"]} == {"R"}
        assert {"S(0)", "S(1)"} <= {placements[2] for _, placements in tp2["params"]}
    n = sum(p.numel() for p in two_nodes[0]["hsdp"]["final"].values())
    assert all(abs(r["hsdp"]["local_numel"] - n / 2) <= 64 for r in two_nodes)  # halves: sharded over 2, not 4


@pytest.mark.parametrize("key", ["hsdp", "tp2_hsdp"])
def test_auto_on_two_nodes_equals_one_process(two_nodes, first_epoch, key) -> None:
    _check_run(two_nodes, key, first_epoch)
    for r in two_nodes:  # every rank ends with the whole model of one process, not only the last
        for name, value in first_epoch["final"].items():
            torch.testing.assert_close(r[key]["final"][name], value, rtol=1e-4, atol=5e-5,
                                       msg=lambda m, name=name: f"{key} {name}: {m}")
