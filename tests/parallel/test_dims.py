"""ParallelDims: the layout arithmetic, checked without any process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_perf.parallel.layout.dims import MESH_DIM_NAMES, ParallelDims, mesh_size


def test_auto_dp_fills_the_world() -> None:
    dims = ParallelDims(tensor_parallel_size=2, pipeline_parallel_size=2, world_size=8)
    assert dims.data_parallel_size == 2 and dims.shape == (2, 2, 1, 2)
    assert (dims.dp_enabled, dims.tp_enabled, dims.pp_enabled) == (True, True, True)
    assert not ParallelDims(world_size=1).dp_enabled
    assert MESH_DIM_NAMES == ("pp", "dp", "cp", "tp")
    cp = ParallelDims(context_parallel_size=2, tensor_parallel_size=2, world_size=8)
    assert cp.data_parallel_size == 2 and cp.shape == (1, 2, 2, 2) and cp.cp_enabled


def test_product_mismatch_shows_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(3\) = 12 != world size 8"):
        ParallelDims(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=3, world_size=8)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tp\(3\) \* pp\(1\) = 3"):
        ParallelDims(tensor_parallel_size=3, world_size=8)
    # with context parallelism the message lists every dimension in mesh order
    with pytest.raises(ValueError, match=r"pp\(1\) \* dp\(2\) \* cp\(2\) \* tp\(1\) = 4 != world size 8"):
        ParallelDims(data_parallel_size=2, context_parallel_size=2, world_size=8)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\(1\) \* pp\(1\) \* cp\(4\) = 4"):
        ParallelDims(context_parallel_size=4, world_size=6)
    assert not (dist.is_available() and dist.is_initialized())


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=0), dict(pipeline_parallel_size=-1),
                                    dict(data_parallel_size=0), dict(data_parallel_size="two"),
                                    dict(tensor_parallel_size=True), dict(context_parallel_size=0),
                                    dict(context_parallel_size=1.5)])
def test_sizes_must_be_positive_integers(kwargs) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        ParallelDims(world_size=4, **kwargs)


def test_coordinates_put_tp_innermost_and_pp_outermost() -> None:
    dims = ParallelDims(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, world_size=8)
    coords = [dims.coordinates(r) for r in range(8)]
    # neighbouring ranks share a tp group; ranks 0..3 are pipeline stage 0
    assert coords[0] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert coords[1] == {"pp": 0, "dp": 0, "cp": 0, "tp": 1}
    assert coords[2] == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}
    assert coords[4] == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    assert coords[7] == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}
    with pytest.raises(ValueError, match="outside world size"):
        dims.coordinates(8)


def test_cp_sits_between_dp_and_tp() -> None:
    dims = ParallelDims(data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2, world_size=8)
    coords = [dims.coordinates(r) for r in range(8)]
    # tp pairs are neighbours, then cp pairs of tp pairs, then dp
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["cp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp"] for c in coords] == [0] * 4 + [1] * 4
    assert str(dims) == "dp2 x cp2 x tp2 x pp1 (world size 8)"


def test_hsdp_splits_dp_into_replicate_and_shard() -> None:
    dims = ParallelDims(tensor_parallel_size=2, replicate_size=2, world_size=8)
    assert (dims.data_parallel_size, dims.replicate_size, dims.shard_size) == (4, 2, 2) and dims.hsdp
    assert dims.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and dims.shape == (1, 2, 2, 1, 2)
    coords = [dims.coordinates(r) for r in range(8)]
    # a shard group is neighbouring ranks (tp pairs of it), the replicas are the two halves of the world
    assert [c["dp_shard"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp_replicate"] for c in coords] == [0] * 4 + [1] * 4
    assert [c["dp"] for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]  # the flat dp rank, as without HSDP
    assert str(dims) == "dp4 (replicate 2 x shard 2) x tp2 x pp1 (world size 8)"
    flat = ParallelDims(tensor_parallel_size=2, world_size=8)  # replicate 1: the mesh of before
    assert not flat.hsdp and flat.mesh_dim_names == MESH_DIM_NAMES and "dp_shard" not in flat.coordinates(0)


def test_auto_replicate_keeps_each_shard_group_in_one_node() -> None:
    assert ParallelDims(replicate_size="auto", num_nodes=2, world_size=16).replicate_size == 2
    assert ParallelDims(replicate_size="auto", world_size=16).replicate_size == 1  # one node: plain FSDP2
    # pipeline stages outermost: with pp2 on 2 nodes each stage is a node, dp is inside it already
    assert ParallelDims(replicate_size="auto", pipeline_parallel_size=2, num_nodes=2, world_size=16).replicate_size == 1
    # pp2 on 4 nodes of 4: a stage spans 2 nodes, so 2 replicas of 4 shards
    assert ParallelDims(replicate_size="auto", pipeline_parallel_size=2, num_nodes=4, world_size=16).replicate_size == 2
    # pp2 on 3 nodes of 4: a stage spans 1.5 nodes; 3 replicas of 2 keep every shard group in a node
    dims = ParallelDims(replicate_size="auto", pipeline_parallel_size=2, num_nodes=3, world_size=12)
    assert (dims.replicate_size, dims.shard_size) == (3, 2)
    with pytest.raises(ValueError, match=r"data-parallel size 6 is not divisible by replicate_size 4: 6 / 4 = 1.5"):
        ParallelDims(replicate_size=4, world_size=6)
    with pytest.raises(ValueError, match="replicate_size must be a positive int or 'auto'"):
        ParallelDims(replicate_size=0, world_size=4)


class _Mesh:
    """A mesh's names and sizes, as ``DeviceMesh`` answers them (no process group)."""

    def __init__(self, **sizes: int) -> None:
        self.sizes = sizes
        self.mesh_dim_names = tuple(sizes)

    def __getitem__(self, name: str) -> "_Mesh":
        return _Mesh(**{name: self.sizes[name]})

    def size(self) -> int:
        out = 1
        for v in self.sizes.values():
            out *= v
        return out


def test_mesh_size_reads_named_dimensions_and_counts_missing_ones_as_one() -> None:
    mesh = _Mesh(pp=2, dp=3, tp=2)
    assert mesh_size(mesh) == 12 and mesh_size(mesh, "tp") == 2
    assert mesh_size(mesh, "dp", "cp") == 3  # no "cp" dimension: one rank along it
    assert mesh_size(mesh, "pp", "dp", "tp") == 12
    # HSDP: "dp" is flattened from ("dp_replicate", "dp_shard"), which the mesh does not list by name
    hsdp = _Mesh(pp=1, dp_replicate=2, dp_shard=3, cp=2, tp=1)
    assert mesh_size(hsdp, "dp") == 6 and mesh_size(hsdp, "dp", "cp") == 12 == mesh_size(hsdp, "dp_cp")
    assert mesh_size(hsdp, "dp_shard_cp") == 6
