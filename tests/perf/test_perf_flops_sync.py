"""OpCounter against FlopCounterMode and the GPT formula; causal halving; bytes; sync-site detection."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_perf.models.gpt import GPT, GPTConfig
from lightning_perf.perf import (
    DispatchSyncDetector,
    OpCounter,
    SyncPointError,
    SyncRecorder,
    classify,
    count_flops,
    op_category,
)

HERE = os.path.basename(__file__)


def test_counter_matches_flop_counter_mode_on_an_mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 32)
    with FlopCounterMode(display=False) as ref:
        model(x).sum().backward()
    with OpCounter() as ours:
        model(x).sum().backward()
    assert ours.by("category")["matmul"]["flops"] == ref.get_total_flops()


def _sdpa_flops(causal: bool) -> int:
    q = torch.randn(2, 4, 64, 16)
    with OpCounter(track_modules=False) as c:
        F.scaled_dot_product_attention(q, q, q, is_causal=causal)
    return c.by("category")["attention"]["flops"]


def test_causal_attention_is_counted_once():
    full = _sdpa_flops(False)
    assert full == 2 * (2 * 2 * 4 * 64 * 64 * 16)  # two matmuls over the full square
    assert _sdpa_flops(True) == full // 2


def test_gpt_model_flops_match_the_config_formula():
    """tiny-llama has no biases: the formula's only extra terms are the norm weights (6 per token each)."""
    cfg = GPTConfig.from_name("tiny-llama", block_size=32, n_layer=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    B, T = 2, 32
    x = torch.randint(0, cfg.vocab_size, (B, T))
    count = count_flops(lambda: model(x, x), lambda loss: loss.backward())
    norm_params = (2 * cfg.n_layer + 1) * cfg.n_embd
    assert count.model == (cfg.flops_per_token(T) - 6 * norm_params) * B * T
    assert count.causal_attention_forward > 0
    # no activation checkpointing: the backward runs twice the forward's matmuls, plus the score
    # matmul SDPA's backward recomputes (half of the attention forward)
    assert count.recomputed == count.causal_attention_forward // 2
    assert count.hardware == count.model + count.recomputed


def test_recomputation_shows_in_hardware_flops_only():
    """Checkpointed lin2(gelu(lin1(x))): the backward recomputes lin1 (lin2's output is not needed)."""
    mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(16, 64, requires_grad=True)

    def forward():
        return torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False).sum()

    count = count_flops(forward, lambda out: out.backward())
    layer = 2 * 16 * 64 * 64
    assert count.forward == 2 * layer
    assert count.model == 6 * layer
    assert count.recomputed == layer
    assert count.hardware == 7 * layer


def test_bytes_and_views():
    a, b = torch.randn(1000), torch.randn(1000)
    with OpCounter(track_modules=False) as c:
        a + b
        a.view(10, 100).t()
    assert c.total_bytes == 3 * 4000  # two inputs read, one output written; views move nothing
    assert c.by("op")["aten::add"]["flops"] == 1000


def test_categories():
    assert op_category(torch.ops.aten.mm.default) == "matmul"
    assert op_category(torch.ops.aten.native_layer_norm.default) == "norm"
    assert op_category(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention"
    assert op_category(torch.ops.aten.copy_.default) == "copy"
    assert op_category(torch.ops.aten.gelu.default) == "elementwise"
    assert op_category(torch.ops.c10d.allreduce_.default) == "communication"


@pytest.mark.parametrize(
    "flops, nbytes, seconds, expected",
    [(1e9, 1e6, 2e-3, "compute"),  # intensity 1000 > ridge 10, 0.5 of the roof
     (1e6, 1e6, 2e-5, "memory"),  # intensity 1 < ridge 10, half the bandwidth roof
     (1e9, 1e6, 1.0, "overhead"),  # 1e9 FLOP/s of a 1e12 roof
     (0, 1e6, 1e-5, "memory"), (0, 0, 1.0, "unknown")],
)
def test_classify(flops, nbytes, seconds, expected):
    assert classify(flops, nbytes, seconds, peak_flops=1e12, peak_bandwidth=1e11) == expected


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "_line(" not in text)


def test_dispatch_detector_finds_each_sync_at_its_line():
    rec = SyncRecorder()
    x = torch.randn(16)
    with DispatchSyncDetector(rec, emulate_host=True):
        y = x * 2 + 1  # clean
        x.sum().item()  # SITE-ITEM
        torch.nonzero(x > 0)  # SITE-NONZERO
        x[x > 0]  # SITE-MASK
        if y.max() > 100:  # SITE-BOOL
            pass
    found = {s.location.split(os.sep)[-1]: s for s in rec.user_sites()}
    for marker in ("SITE-ITEM", "SITE-NONZERO", "SITE-MASK", "SITE-BOOL"):
        assert f"{HERE}:{_line(marker)}" in found, (marker, sorted(found))
    assert len(found) == 4
    assert rec.framework_sites() == []


def test_error_mode_raises_at_user_site():
    rec = SyncRecorder(raise_on_user=True)
    with pytest.raises(SyncPointError, match=f"{HERE}:{_line('SITE-RAISE')}"):
        with DispatchSyncDetector(rec, emulate_host=True):
            torch.ones(3).sum().item()  # SITE-RAISE


def test_inner_kernel_ops_are_timed_in_their_category():
    """The counter sees the outer SDPA op; the profiler puts the kernel time on the inner op."""
    from lightning_perf.perf import OpRecord, build_groups

    records = [OpRecord(op="aten::_scaled_dot_product_flash_attention", category="attention", module="M",
                        calls=1, flops=int(1e9), bytes=int(1e6)),
               OpRecord(op="aten::mm", category="matmul", module="M", calls=1, flops=int(1e9), bytes=int(1e6))]
    times = {"aten::_flash_attention_forward": 2e-3, "aten::mm": 2e-3, "aten::linear": 0.0}
    groups = {g.name: g for g in build_groups(records, times, key="category", peak_flops=1e12, peak_bandwidth=1e11)}
    assert groups["attention"].seconds == pytest.approx(2e-3) and groups["attention"].flops == 1e9
    assert groups["attention"].bound == "compute"
    assert groups["attention"].time_share == pytest.approx(0.5)


def test_optimizer_step_counters_are_not_sync_sites():
    """Adam keeps its step count on the host (it stays there on GPU too): not a sync site."""
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    rec = SyncRecorder()
    with DispatchSyncDetector(rec, emulate_host=True):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert rec.sites == {}


def test_grouped_query_attention_counts_as_its_query_heads():
    """SDPA with fewer k/v heads (enable_gqa) costs what it costs with k/v expanded to the query's
    heads, forward and backward; torch 2.11's own formula rejects the shapes, 2.13's accepts them."""
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, requires_grad=True)

    def grouped():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()

    def expanded():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=True).sum()

    a = count_flops(grouped, lambda out: out.backward())
    b = count_flops(expanded, lambda out: out.backward())
    assert a.causal_attention_forward > 0
    assert a.causal_attention_forward == b.causal_attention_forward
    assert a.model == b.model and a.hardware == b.hardware
