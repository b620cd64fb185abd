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

HSDP (``replicate`` R > 1) splits "dp" in two, replicate outermost: the mesh is
(pp, dp_replicate, dp_shard, cp, tp), so a "dp_shard" group is a block of consecutive ranks
(one node, or part of one) and only the replicas' gradient all-reduce crosses nodes; "dp" is
then the flattened (dp_replicate, dp_shard) dimension. :func:`replicate_shape` resolves R
(``"auto"``: one replica per node) and checks it, for ZeRO and 3D alike.

ZeRO alone uses a ("dp",) mesh, or for HSDP a ("dp_replicate", "dp_shard") mesh
(:func:`build_zero_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any, Literal, Optional, Union

__all__ = ["ParallelDims", "MESH_DIM_NAMES", "data_parallel_mesh", "build_zero_mesh", "fsdp_mesh",
           "check_replicate_size", "replicate_shape", "check_size", "mesh_size"]

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
#: the flattened ("dp", "cp") dimension: the ranks that hold the same parameters
DP_CP = "dp_cp"
#: HSDP: parameters replicated over "dp_replicate" (across nodes), sharded over "dp_shard" (within one)
DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"
#: HSDP with context parallelism: FSDP2 shards over the flattened ("dp_shard", "cp") dimension
DP_SHARD_CP = "dp_shard_cp"
#: the flattened dimensions build_mesh adds, and what each flattens
_FLATTENED = {"dp": (DP_REPLICATE, DP_SHARD), DP_CP: ("dp", "cp"), DP_SHARD_CP: (DP_SHARD, "cp")}


def check_replicate_size(replicate_size: Any, *, fsdp_needs: Optional[str] = None,
                         fp8_all_gather: bool = False) -> None:
    """Raise unless ``replicate_size`` is a positive int or ``"auto"``; for R != 1 (HSDP), also when
    the strategy does not shard with FSDP2 (``fsdp_needs``: what it would take, ``None``: it does)
    or gathers FP8 weights, which HSDP does not support."""
    r = replicate_size
    if r != "auto" and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        raise ValueError(f"replicate_size must be a positive int or 'auto' (the number of nodes), got {r!r}")
    if r == 1:
        return
    if fsdp_needs is not None:
        raise ValueError(
            f"replicate_size (HSDP: shard within a group, replicate across groups) needs FSDP2: {fsdp_needs}")
    if fp8_all_gather:
        raise ValueError("fp8_all_gather with replicate_size != 1 (HSDP) is not supported: use one of them")


def replicate_shape(size: int, replicate_size: Union[int, Literal["auto"]], *, num_nodes: int = 1,
                    stages: int = 1, size_name: str = "world size",
                    divides: str = "the number of processes") -> tuple[int, int]:
    """(replicate, shard): ``size`` data-parallel ranks as R replicas of ``size / R`` shards.

    ``"auto"`` is the fewest replicas whose shard groups each stay inside one node: the number of
    nodes, divided by the pipeline ``stages`` that share a node (``num_nodes / gcd(num_nodes,
    stages)``; ``stages`` is 1 for ZeRO). Raises with the arithmetic when ``size`` does not divide.
    """
    check_replicate_size(replicate_size)
    if replicate_size == "auto":
        replicate = num_nodes // gcd(num_nodes, stages)
        source = (f"replicate_size='auto' = num_nodes ({num_nodes})" if stages == 1 else
                  f"replicate_size='auto' = num_nodes / gcd(num_nodes, pp) = {num_nodes} / "
                  f"{gcd(num_nodes, stages)} ({replicate})")
    else:
        assert isinstance(replicate_size, int)
        replicate, source = replicate_size, f"replicate_size {replicate_size}"
    if size % replicate:
        raise ValueError(
            f"{size_name} {size} is not divisible by {source}: {size} / {replicate} = {size / replicate:.3g}; "
            f"choose a replicate size that divides {divides}")
    return (replicate, size // replicate)


def check_size(name: str, value: Any) -> int:
    """``value`` if it is a positive int, else a ``ValueError`` naming ``name``: the one check of every
    layout size (the 3D config's, :class:`ParallelDims`', a pipeline schedule's)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def mesh_size(mesh: Any, *dims: str) -> int:
    """The number of ranks of ``mesh`` along ``dims`` together (all of it: none named); a dimension the
    mesh does not have counts 1. A flattened dimension of :meth:`ParallelDims.build_mesh` ("dp" under
    HSDP, "dp_cp", "dp_shard_cp"), which a mesh does not list among its names, counts as the dimensions
    it flattens. The one way the package reads a size off a built mesh."""
    if not dims:
        return int(mesh.size())
    names = mesh.mesh_dim_names or ()
    size = 1
    for dim in dims:
        if dim in names:
            size *= int(mesh[dim].size())
        elif dim in _FLATTENED:
            size *= mesh_size(mesh, *_FLATTENED[dim])
    return size


@dataclass(kw_only=True)
class ParallelDims:
    """Sizes of the four parallel dimensions on ``world_size`` processes; their product is the world.

    Args:
        data_parallel_size: data-parallel replicas (``"auto"``: whatever ``world_size / (pp * cp * tp)``
            leaves; an int once built).
        tensor_parallel_size: tensor-parallel ranks per model replica (innermost mesh dimension).
        pipeline_parallel_size: pipeline-parallel ranks per model replica (outermost mesh dimension).
        context_parallel_size: context-parallel ranks per model replica, each holding ``1 / cp`` of every
            sequence.
        world_size: the number of processes.
        replicate_size: HSDP: the data-parallel ranks as ``replicate_size`` groups of ``shard_size`` shards
            (``"auto"``: see :func:`replicate_shape`; an int once built); 1 keeps one flat "dp" dimension.
        num_nodes: the nodes the world spans (for ``replicate_size="auto"``).
    """

    data_parallel_size: Union[int, Literal["auto"]] = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    world_size: int
    replicate_size: Union[int, Literal["auto"]] = 1
    num_nodes: int = 1

    def __post_init__(self) -> None:
        check_size("world_size", self.world_size)
        tp = check_size("tensor_parallel_size", self.tensor_parallel_size)
        pp = check_size("pipeline_parallel_size", self.pipeline_parallel_size)
        cp = check_size("context_parallel_size", self.context_parallel_size)
        model_ranks = tp * pp * cp
        if self.data_parallel_size == "auto":
            if self.world_size % model_ranks:
                others = f"tp({tp}) * pp({pp})" + (f" * cp({cp})" if cp > 1 else "")
                raise ValueError(
                    f"world size {self.world_size} is not divisible by {others} = "
                    f"{model_ranks}, so the data-parallel size cannot be derived: "
                    f"{self.world_size} / {model_ranks} = {self.world_size / model_ranks:.3g}; run on a multiple of "
                    f"{model_ranks} processes (devices x num_nodes) or change the layout"
                )
            self.data_parallel_size = self.world_size // model_ranks
        dp = check_size("data_parallel_size", self.data_parallel_size)
        product = dp * model_ranks
        if product != self.world_size:
            raise ValueError(
                f"{self._arithmetic()} = {product} != world size {self.world_size}; "
                f"choose sizes whose product is the number of processes (or data_parallel_size='auto')"
            )
        check_size("num_nodes", self.num_nodes)
        self.replicate_size, _ = replicate_shape(dp, self.replicate_size, num_nodes=self.num_nodes, stages=pp,
                                                 size_name="data-parallel size", divides="the data-parallel size")

    def _arithmetic(self) -> str:
        dp, tp, pp, cp = (self.data_parallel_size, self.tensor_parallel_size, self.pipeline_parallel_size,
                          self.context_parallel_size)
        if cp == 1:  # the three-dimensional layout reads as it always has
            return f"dp({dp}) * tp({tp}) * pp({pp})"
        return f"pp({pp}) * dp({dp}) * cp({cp}) * tp({tp})"

    @property
    def _dp(self) -> int:
        assert isinstance(self.data_parallel_size, int)
        return self.data_parallel_size

    @property
    def _replicas(self) -> int:
        assert isinstance(self.replicate_size, int)
        return self.replicate_size

    @property
    def dp_cp_size(self) -> int:
        """The ranks that hold the same parameters (dp x cp): FSDP2 shards over them, gradients average over them."""
        return self._dp * self.context_parallel_size

    @property
    def shard_size(self) -> int:
        """HSDP: the data-parallel ranks of one replica group (``data_parallel_size`` without HSDP)."""
        return self._dp // self._replicas

    @property
    def hsdp(self) -> bool:
        return self._replicas > 1

    @property
    def dp_enabled(self) -> bool:
        return self._dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline_parallel_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.context_parallel_size > 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """``MESH_DIM_NAMES``, with "dp" split into ("dp_replicate", "dp_shard") under HSDP."""
        if not self.hsdp:
            return MESH_DIM_NAMES
        return ("pp", DP_REPLICATE, DP_SHARD, "cp", "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape in ``mesh_dim_names`` order: (pp, dp, cp, tp), or (pp, dp_replicate, dp_shard,
        cp, tp) under HSDP."""
        pp, cp, tp = self.pipeline_parallel_size, self.context_parallel_size, self.tensor_parallel_size
        if self.hsdp:
            return (pp, self._replicas, self.shard_size, cp, tp)
        return (pp, self._dp, cp, tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's (pp, dp, cp, tp) coordinates (and under HSDP its dp_replicate and dp_shard ones,
        ``dp = dp_replicate * shard_size + dp_shard``), computed without a process group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        tp_rank = rank % tp
        cp_rank = (rank // tp) % cp
        dp_rank = (rank // (tp * cp)) % self._dp
        pp_rank = rank // (tp * cp * self._dp)
        coords = {"pp": pp_rank, "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}
        if self.hsdp:
            coords[DP_REPLICATE], coords[DP_SHARD] = divmod(dp_rank, self.shard_size)
        return coords

    def build_mesh(self, device_type: str) -> Any:
        """One ``DeviceMesh`` of shape (pp, dp, cp, tp) named ``("pp", "dp", "cp", "tp")``.

        Needs an initialised default process group; slice it by name
        (``mesh["tp"]``, ``mesh["dp"]``) for the per-dimension meshes. With context
        parallelism the mesh also has the flattened ``"dp_cp"`` dimension (see
        :func:`data_parallel_mesh`). Under HSDP the mesh is (pp, dp_replicate, dp_shard, cp, tp)
        and "dp" the flattened (dp_replicate, dp_shard) dimension, so ``mesh["dp"]`` names the
        same ranks in the same order as without HSDP; with context parallelism it also has
        ``"dp_shard_cp"``, over which FSDP2 shards (:func:`fsdp_mesh`).
        """
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.mesh_dim_names)
        dp_dims: tuple[str, ...] = ("dp",)
        if self.hsdp:
            dp_dims = (DP_REPLICATE, DP_SHARD)
            mesh[dp_dims]._flatten("dp")
            if self.cp_enabled:
                mesh[DP_SHARD, "cp"]._flatten(DP_SHARD_CP)
        if self.cp_enabled:
            mesh[(*dp_dims, "cp")]._flatten(DP_CP)
        return mesh

    def __str__(self) -> str:
        dp = self.data_parallel_size
        cp = f" x cp{self.context_parallel_size}" if self.cp_enabled else ""
        dp_text = f"dp{dp}" if not self.hsdp else f"dp{dp} (replicate {self._replicas} x shard {self.shard_size})"
        return (f"{dp_text}{cp} x tp{self.tensor_parallel_size} x pp{self.pipeline_parallel_size} "
                f"(world size {self.world_size})")


def data_parallel_mesh(mesh: Any) -> Any:
    """The ranks that hold the same parameters and average their gradients: ``mesh["dp"]``, or
    the flattened ("dp", "cp") dimension when the mesh has context parallelism (a ("pp", "dp", "tp")
    mesh built without a "cp" dimension has none)."""
    if mesh_size(mesh, "cp") > 1:
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
    """The mesh to give ``fully_shard``: 2-D (replicate, shard) for HSDP, else the 1-D data-parallel
    mesh. With context parallelism (a 3D mesh) parameters are sharded over "cp" too: the shard
    dimension is "dp_shard_cp" under HSDP, else the whole "dp_cp"."""
    names = mesh.mesh_dim_names or ()
    cp = mesh_size(mesh, "cp") > 1
    if DP_SHARD in names:
        return mesh[DP_REPLICATE, DP_SHARD_CP if cp else DP_SHARD]
    if "dp" in names and mesh.ndim > 1:
        return data_parallel_mesh(mesh)
    return mesh
