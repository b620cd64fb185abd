"""ParallelDims: the layout arithmetic, checked without any process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_perf.parallel.dims import MESH_DIM_NAMES, ParallelDims


def test_auto_dp_fills_the_world() -> None:
    dims = ParallelDims(tp=2, pp=2, world_size=8)
    assert dims.dp == 2 and dims.shape == (2, 2, 1, 2)
    assert (dims.dp_enabled, dims.tp_enabled, dims.pp_enabled) == (True, True, True)
    assert not ParallelDims(world_size=1).dp_enabled
    assert MESH_DIM_NAMES == ("pp", "dp", "cp", "tp")
    cp = ParallelDims(cp=2, tp=2, world_size=8)
    assert cp.dp == 2 and cp.shape == (1, 2, 2, 2) and cp.cp_enabled


def test_product_mismatch_shows_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(3\) = 12 != world size 8"):
        ParallelDims(dp=2, tp=2, pp=3, world_size=8)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tp\(3\) \* pp\(1\) = 3"):
        ParallelDims(tp=3, world_size=8)
    # with context parallelism the message lists every dimension in mesh order
    with pytest.raises(ValueError, match=r"pp\(1\) \* dp\(2\) \* cp\(2\) \* tp\(1\) = 4 != world size 8"):
        ParallelDims(dp=2, cp=2, world_size=8)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\(1\) \* pp\(1\) \* cp\(4\) = 4"):
        ParallelDims(cp=4, world_size=6)
    assert not (dist.is_available() and dist.is_initialized())


@pytest.mark.parametrize("kwargs", [dict(tp=0), dict(pp=-1), dict(dp=0), dict(dp="two"), dict(tp=True), dict(cp=0),
                                    dict(cp=1.5)])
def test_sizes_must_be_positive_integers(kwargs) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        ParallelDims(world_size=4, **kwargs)


def test_coordinates_put_tp_innermost_and_pp_outermost() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
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
    dims = ParallelDims(dp=2, cp=2, tp=2, world_size=8)
    coords = [dims.coordinates(r) for r in range(8)]
    # tp pairs are neighbours, then cp pairs of tp pairs, then dp
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["cp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp"] for c in coords] == [0] * 4 + [1] * 4
    assert str(dims) == "dp2 x cp2 x tp2 x pp1 (world size 8)"
