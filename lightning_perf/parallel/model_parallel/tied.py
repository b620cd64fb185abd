"""Parameters that the first and the last pipeline stage share: a tied token embedding and LM head.

Such a parameter is used on two pipeline ranks, so each holds a copy, under the parameter's
one name (the first stage as its embedding, the last as its head). The copies start equal
(:meth:`TiedParameters.broadcast_` from the first stage's copy) and stay equal: after the
schedule's backward, the two copies' gradients are summed over the *embedding group*, the
first- and the last-stage rank of one (dp, cp, tp) coordinate, so both take the same optimizer
step. The sum pairs matching pieces: a tensor-parallel shard with the same shard of the other
copy, a ZeRO shard with the same shard (both stages shard the parameter over the same ranks).

Elsewhere the copies count once: gradient clipping leaves the last stage's copy out of the
global norm (:attr:`TiedParameters.counted_elsewhere`), and a checkpoint holds the name once
(DCP writes one of two equal entries under one key), so it loads into any layout, one process
included. Where the first and the last stage run on one rank (V placement), the two uses share
one parameter and autograd sums them: there is no group and nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_perf.parallel.model_parallel.pipeline import PipelineConfig, stage_owner

__all__ = [
    "TiedParameters",
    "shared_parameters",
    "tied_parameter_names",
    "embedding_group_ranks",
    "check_tied_layout",
]


def shared_parameters(model: nn.Module, num_stages: int) -> dict[str, list[int]]:
    """``{name: stages}`` of each parameter of ``model`` that several of its ``num_stages`` stages use.

    Builds every stage through the protocol's ``pipeline_stage(i, n)`` (views sharing ``model``'s
    modules: nothing is allocated, meta tensors included).
    """
    stages_of: dict[int, list[int]] = {}
    for i in range(num_stages):
        stage = model.pipeline_stage(i, num_stages)  # type: ignore[operator]
        for p in stage.parameters():  # each parameter once per stage
            stages_of.setdefault(id(p), []).append(i)
    return {name: stages_of[id(p)] for name, p in model.named_parameters() if len(stages_of.get(id(p), ())) > 1}


def tied_parameter_names(model: nn.Module, num_stages: int) -> list[str]:
    """Names of the parameters the first and the last of ``num_stages`` stages share.

    Raises ``ValueError`` for a parameter shared by any other stages: only the first and the last
    stage may share one (the embedding group sums their gradients).
    """
    if num_stages < 2:
        return []
    shared = shared_parameters(model, num_stages)
    ends = [0, num_stages - 1]
    other = {name: stages for name, stages in shared.items() if stages != ends}
    if other:
        name, stages = next(iter(sorted(other.items())))
        raise ValueError(
            f"{name} is used by pipeline stages {stages} of {num_stages}: only the first and the last stage may "
            f"share a parameter (a tied embedding and LM head); give the other stages their own parameters"
        )
    return sorted(shared)


def check_tied_layout(pipeline: PipelineConfig, *, zero_sharded: bool) -> None:
    """Raise for a layout that cannot keep tied copies (checked with numbers, before any process group).

    ``zero_sharded``: FSDP2 shards parameters over the data-parallel ranks (ZeRO 1-3 with dp > 1).
    Under V placement the first and the last stage run on one rank and share one parameter, which
    two stages' FSDP2 units cannot both shard.
    """
    if pipeline.pipeline_parallel_size > 1 and pipeline.placement == "v" and zero_sharded:
        raise ValueError(
            f"pipeline_schedule={pipeline.schedule!r} runs the first and the last stage on one rank, where a tied "
            "LM head and the token embedding are one parameter that two stages' ZeRO units cannot both shard: "
            "use zero_stage=0 (gradients all-reduced over dp), a schedule with loop placement ('1f1b', "
            "'interleaved_1f1b', 'zero_bubble', ...), or an untied head (tie_embeddings=False)"
        )


def embedding_group_ranks(mesh_ranks: torch.Tensor, first: int, last: int) -> list[list[int]]:
    """The global ranks of every embedding group: ``[first-stage rank, last-stage rank]`` per coordinate.

    ``mesh_ranks``: global ranks with the pipeline dimension first (``DeviceMesh.mesh`` of the
    (pp, dp, cp, tp) mesh); ``first`` and ``last``: the pipeline ranks that hold the two stages.
    """
    a = mesh_ranks[first].reshape(-1).tolist()
    b = mesh_ranks[last].reshape(-1).tolist()
    return [[int(x), int(y)] for x, y in zip(a, b)]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _in_place(collective: Any, t: torch.Tensor) -> None:
    """Run ``collective(buffer)`` on ``t``'s values in place (collectives need a contiguous buffer)."""
    if t.is_contiguous():
        collective(t)
    else:
        buf = t.contiguous()
        collective(buf)
        t.copy_(buf)


@dataclass
class TiedParameters:
    """This rank's copies of the tied parameters and its embedding group (see the module docstring).

    Build it with :meth:`build`, a collective over the whole world.
    """

    names: list[str]
    params: list[nn.Parameter]  # this rank's copies, in ``names`` order
    group: Any  # the embedding group: this rank and its peer holding the other stage
    src: int  # global rank of the first stage's copy
    first: bool  # this rank holds the first stage

    @classmethod
    def build(cls, model: nn.Module, names: list[str], mesh: Any,
              pipeline: PipelineConfig) -> Optional["TiedParameters"]:
        """The tied copies of pruned ``model`` on this rank of the (pp, dp, cp, tp) ``mesh``.

        Every rank must call it (it creates every embedding group). ``None`` on a rank that holds
        neither the first nor the last stage, where the two share a rank, or when nothing is tied.
        """
        first = stage_owner(0, pipeline.pipeline_parallel_size, pipeline.placement)
        last = pipeline.last_stage_rank()
        if not names or first == last:
            return None
        dims = list(mesh.mesh_dim_names)
        ranks = mesh.mesh.movedim(dims.index("pp"), 0)
        pairs = embedding_group_ranks(ranks, first, last)
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        me = dist.get_rank()
        pair = next((p for p in pairs if me in p), None)
        if pair is None:
            return None
        params = dict(model.named_parameters())
        missing = [n for n in names if n not in params]
        if missing:
            raise RuntimeError(f"this rank holds the first or the last stage but not the tied {missing}")
        return cls(names=list(names), params=[params[n] for n in names], group=group, src=pair[0],
                   first=me == pair[0])

    @property
    def counted_elsewhere(self) -> list[nn.Parameter]:
        """Copies whose gradient the first stage's rank counts in a global norm (the last stage's)."""
        return [] if self.first else list(self.params)

    @torch.no_grad()
    def broadcast_(self) -> None:
        """Make the last stage's copies equal to the first stage's (after initialisation)."""
        for p in self.params:
            _in_place(lambda t: dist.broadcast(t, src=self.src, group=self.group), _local(p))

    def hold_grads(self) -> list[Optional[torch.Tensor]]:
        """Set aside the copies' gradients (earlier accumulation) so the next backward's stand alone."""
        held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return held

    @torch.no_grad()
    def reduce_grads_(self, held: list[Optional[torch.Tensor]]) -> None:
        """Sum the gradients made since :meth:`hold_grads` over the embedding group, then add ``held`` back."""
        for p, old in zip(self.params, held):
            if p.grad is None:  # both ranks must join the sum
                p.grad = torch.zeros_like(p)
            grad = _like_param(p.grad, p)
            _in_place(lambda t: dist.all_reduce(t, group=self.group), _local(grad))
            if old is not None:
                old = _like_param(old, p)
                _local(old).add_(_local(grad))
                grad = old
            p.grad = grad


def _like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out as ``param`` (a vocabulary-parallel embedding's gradient comes back replicated,
    the head's sharded): then the two copies' local pieces match, shard for shard."""
    placements = getattr(param, "placements", None)
    if placements is None or getattr(grad, "placements", None) == placements:
        return grad
    return grad.redistribute(param.device_mesh, placements)
