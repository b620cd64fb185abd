"""The parallel layout: how many ranks go to data, tensor and pipeline parallelism.

``ParallelDims`` is checked with plain numbers when it is built (no process group
needed), so an impossible layout fails on every rank with the arithmetic in the
message, before anything can hang. ``build_mesh`` then creates one named
``DeviceMesh`` of shape (pp, dp, tp): tensor parallelism is innermost, so its
ranks are neighbours (the same host, the fastest links); pipeline parallelism is
outermost, since it only sends activations between neighbouring stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

__all__ = ["ParallelDims", "MESH_DIM_NAMES"]

MESH_DIM_NAMES = ("pp", "dp", "tp")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(kw_only=True)
class ParallelDims:
    """Sizes of the three parallel dimensions; ``dp * tp * pp == world_size``.

    Args:
        dp: data-parallel replicas (``"auto"``: whatever ``world_size / (tp * pp)`` leaves).
        tp: tensor-parallel ranks per model replica (innermost mesh dimension).
        pp: pipeline-parallel ranks per model replica (outermost mesh dimension).
        world_size: the number of processes.
    """

    dp: Union[int, Literal["auto"]] = "auto"
    tp: int = 1
    pp: int = 1
    world_size: int

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("tensor_parallel_size (tp)", self.tp)
        _positive_int("pipeline_parallel_size (pp)", self.pp)
        model_ranks = self.tp * self.pp
        if self.dp == "auto":
            if self.world_size % model_ranks:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by tp({self.tp}) * pp({self.pp}) = "
                    f"{model_ranks}, so the data-parallel size cannot be derived: "
                    f"{self.world_size} / {model_ranks} = {self.world_size / model_ranks:.3g}"
                )
            self.dp = self.world_size // model_ranks
        _positive_int("data_parallel_size (dp)", self.dp)
        product = self.dp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {product} != world size {self.world_size}; "
                f"choose sizes whose product is the number of processes (or dp='auto')"
            )

    @property
    def dp_size(self) -> int:
        assert isinstance(self.dp, int)
        return self.dp

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh shape in ``MESH_DIM_NAMES`` order: (pp, dp, tp)."""
        return (self.pp, self.dp_size, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's (pp, dp, tp) coordinates, computed without a process group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp_size
        pp_rank = rank // (self.tp * self.dp_size)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}

    def build_mesh(self, device_type: str) -> Any:
        """One ``DeviceMesh`` of shape (pp, dp, tp) named ``("pp", "dp", "tp")``.

        Needs an initialised default process group; slice it by name
        (``mesh["tp"]``, ``mesh["dp"]``) for the per-dimension meshes.
        """
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)

    def __str__(self) -> str:
        return f"dp{self.dp} x tp{self.tp} x pp{self.pp} (world size {self.world_size})"
