"""The parallel layout: how many ranks go to data, context, tensor and pipeline parallelism.

``ParallelDims`` is checked with plain numbers when it is built (no process group
needed), so an impossible layout fails on every rank with the arithmetic in the
message, before anything can hang. ``build_mesh`` then creates one named
``DeviceMesh`` of shape (pp, dp, cp, tp): tensor parallelism is innermost, so its
ranks are neighbours (the same host, the fastest links); context parallelism next,
since it gathers keys and values every layer; pipeline parallelism is outermost,
since it only sends activations between neighbouring stages.

Parameters are replicated over "cp" (each cp rank holds a part of every sequence), so
gradients are averaged, and FSDP2 shards, over "dp" and "cp" together: the mesh's
flattened ``"dp_cp"`` dimension (:func:`data_parallel_mesh`).

ZeRO alone uses a ("dp",) mesh, or for HSDP a ("dp_replicate", "dp_shard") mesh
(:func:`build_zero_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

__all__ = ["ParallelDims", "MESH_DIM_NAMES", "data_parallel_mesh", "build_zero_mesh", "fsdp_mesh"]

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
#: the flattened ("dp", "cp") dimension: the ranks that hold the same parameters
DP_CP = "dp_cp"
#: HSDP: parameters replicated over "dp_replicate" (across nodes), sharded over "dp_shard" (within one)
DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(kw_only=True)
class ParallelDims:
    """Sizes of the four parallel dimensions; ``pp * dp * cp * tp == world_size``.

    Args:
        dp: data-parallel replicas (``"auto"``: whatever ``world_size / (pp * cp * tp)`` leaves).
        tp: tensor-parallel ranks per model replica (innermost mesh dimension).
        pp: pipeline-parallel ranks per model replica (outermost mesh dimension).
        cp: context-parallel ranks per model replica, each holding ``1 / cp`` of every sequence.
        world_size: the number of processes.
    """

    dp: Union[int, Literal["auto"]] = "auto"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    world_size: int

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("tensor_parallel_size (tp)", self.tp)
        _positive_int("pipeline_parallel_size (pp)", self.pp)
        _positive_int("context_parallel_size (cp)", self.cp)
        model_ranks = self.tp * self.pp * self.cp
        if self.dp == "auto":
            if self.world_size % model_ranks:
                others = f"tp({self.tp}) * pp({self.pp})" + (f" * cp({self.cp})" if self.cp > 1 else "")
                raise ValueError(
                    f"world size {self.world_size} is not divisible by {others} = "
                    f"{model_ranks}, so the data-parallel size cannot be derived: "
                    f"{self.world_size} / {model_ranks} = {self.world_size / model_ranks:.3g}"
                )
            self.dp = self.world_size // model_ranks
        _positive_int("data_parallel_size (dp)", self.dp)
        product = self.dp * model_ranks
        if product != self.world_size:
            raise ValueError(
                f"{self._arithmetic()} = {product} != world size {self.world_size}; "
                f"choose sizes whose product is the number of processes (or dp='auto')"
            )

    def _arithmetic(self) -> str:
        if self.cp == 1:  # the three-dimensional layout reads as it always has
            return f"dp({self.dp}) * tp({self.tp}) * pp({self.pp})"
        return f"pp({self.pp}) * dp({self.dp}) * cp({self.cp}) * tp({self.tp})"

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
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh shape in ``MESH_DIM_NAMES`` order: (pp, dp, cp, tp)."""
        return (self.pp, self.dp_size, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's (pp, dp, cp, tp) coordinates, computed without a process group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp_size
        pp_rank = rank // (self.tp * self.cp * self.dp_size)
        return {"pp": pp_rank, "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}

    def build_mesh(self, device_type: str) -> Any:
        """One ``DeviceMesh`` of shape (pp, dp, cp, tp) named ``("pp", "dp", "cp", "tp")``.

        Needs an initialised default process group; slice it by name
        (``mesh["tp"]``, ``mesh["dp"]``) for the per-dimension meshes. With context
        parallelism the mesh also has the flattened ``"dp_cp"`` dimension (see
        :func:`data_parallel_mesh`).
        """
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        if self.cp_enabled:
            mesh["dp", "cp"]._flatten(DP_CP)
        return mesh

    def __str__(self) -> str:
        cp = f" x cp{self.cp}" if self.cp_enabled else ""
        return f"dp{self.dp}{cp} x tp{self.tp} x pp{self.pp} (world size {self.world_size})"


def data_parallel_mesh(mesh: Any) -> Any:
    """The ranks that hold the same parameters and average their gradients: ``mesh["dp"]``, or
    the flattened ("dp", "cp") dimension when the mesh has context parallelism (a ("pp", "dp", "tp")
    mesh built without a "cp" dimension has none)."""
    if "cp" in (mesh.mesh_dim_names or ()) and mesh["cp"].size() > 1:
        return mesh[DP_CP]
    return mesh["dp"]


def build_zero_mesh(device_type: str, replicate: int, shard: int) -> Any:
    """The ZeRO mesh: ("dp",) over ``shard`` ranks when ``replicate == 1``, else HSDP's
    ("dp_replicate", "dp_shard") mesh of shape (replicate, shard).

    Ranks are laid out row-major, so a "dp_shard" group is ``shard`` consecutive ranks (one
    node when ``shard`` is the processes per node) and a "dp_replicate" group takes the same
    local rank on every node. Needs an initialised default process group.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("dp",))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(DP_REPLICATE, DP_SHARD))


def fsdp_mesh(mesh: Any) -> Any:
    """The mesh to give ``fully_shard``: 2-D (replicate, shard) for HSDP, else the 1-D "dp"."""
    if DP_SHARD in (mesh.mesh_dim_names or ()):
        return mesh[DP_REPLICATE, DP_SHARD]
    return mesh["dp"] if mesh.ndim > 1 else mesh
