"""Tied parameters across pipeline stages, without a process group: which parameters, which ranks, which layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_perf.models.gpt import GPT, GPTConfig
from lightning_perf.parallel.model_parallel.pipeline import PipelineConfig
from lightning_perf.parallel.model_parallel.tied import (
    check_tied_layout,
    embedding_group_ranks,
    shared_parameters,
    tied_parameter_names,
)
from lightning_perf.parallel.sharding.gradients import clip_grad_norm_3d


def _meta_gpt(**kw) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.from_name("tiny", **kw))


def test_a_tied_gpt_shares_its_embedding_between_the_first_and_last_stage() -> None:
    tied = _meta_gpt()
    assert tied_parameter_names(tied, 2) == ["tok_emb.weight"]
    assert shared_parameters(tied, 4) == {"tok_emb.weight": [0, 3]}
    assert tied_parameter_names(tied, 1) == []  # one stage: one parameter, nothing to keep equal
    assert tied_parameter_names(_meta_gpt(tie_embeddings=False), 4) == []


class _Chain(nn.Module):
    """Three stages; ``shared`` is used by stages 0 and 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
        self.b.weight = self.a.weight

    def pipeline_stage(self, i: int, n: int) -> nn.Module:
        return [self.a, self.b, self.c][i]


def test_sharing_between_other_stages_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^a\.weight is used by pipeline stages \[0, 1\] of 3: only the first and "
                                         r"the last stage may share a parameter"):
        tied_parameter_names(_Chain(), 3)


def test_embedding_groups_pair_first_and_last_stage_ranks() -> None:
    # (pp=3, dp=2, cp=1, tp=2): rank = ((pp * 2 + dp) * 1 + cp) * 2 + tp
    ranks = torch.arange(12).view(3, 2, 1, 2)
    assert embedding_group_ranks(ranks, 0, 2) == [[0, 8], [1, 9], [2, 10], [3, 11]]


def test_tied_layouts_refused_before_any_process_group() -> None:
    zbv = PipelineConfig(pipeline_parallel_size=2, schedule="zbv_zero_bubble", stages_per_rank=2, num_microbatches=4)
    with pytest.raises(ValueError, match=r"runs the first and the last stage on one rank.*use zero_stage=0"):
        check_tied_layout(zbv, zero_sharded=True)
    check_tied_layout(zbv, zero_sharded=False)  # one parameter on rank 0: autograd sums both uses
    check_tied_layout(PipelineConfig(pipeline_parallel_size=2), zero_sharded=True)  # copies on two ranks, sharded alike


def test_clipping_counts_a_copy_held_elsewhere_once() -> None:
    a, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3, 3))
    for p in (a, b):
        p.grad = torch.ones_like(p)
    # b's gradient is counted by another rank: the norm is that of a alone, sqrt(4) = 2; both are clipped
    norm = clip_grad_norm_3d([a, b], 1.0, counted_elsewhere=[b])
    assert norm.item() == 2.0
    torch.testing.assert_close(a.grad, torch.full((2, 2), 0.5), rtol=1e-5, atol=0)
    torch.testing.assert_close(b.grad, torch.full((3, 3), 0.5), rtol=1e-5, atol=0)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    assert clip_grad_norm_3d([a, b], 100.0).item() == pytest.approx(13**0.5)
