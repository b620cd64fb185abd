"""Ring attention: the block schedule (numbers only), one block's backward against autograd, and on
a cp2 group (gloo) the op against full causal attention and a tiny GPT trained a few steps against
one process and against the all-gather mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _attention_case import causal_gqa_case
from _spawn import spawn

from lightning_perf.parallel.model_parallel.context_parallel import load_balanced_positions, split_sequence
from lightning_perf.parallel.model_parallel.ring_attention import block_attention, block_attention_backward, ring_steps


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_steps_cover_the_causal_triangle_once(cp: int) -> None:
    """Every (query chunk, key chunk) pair with key <= query is computed exactly once over all ranks
    and steps, causally on the diagonal and in full below it; every rank does 3 + 2 (cp - 1) blocks,
    the same at each step."""
    seen: dict[tuple[int, int], bool] = {}
    for rank in range(cp):
        chunks = [rank, 2 * cp - 1 - rank]  # global chunk of each local half
        steps = ring_steps(rank, cp)
        assert [src for src, _ in steps] == [(rank - s) % cp for s in range(cp)]
        assert [len(b) for _, b in steps] == [3] + [2] * (cp - 1)
        for src, blocks in steps:
            key_chunks = [src, 2 * cp - 1 - src]
            for i, j, causal in blocks:
                pair = (chunks[i], key_chunks[j])
                assert pair not in seen
                seen[pair] = causal
    want = {(g, h): g == h for g in range(2 * cp) for h in range(g + 1)}
    assert seen == want


def test_block_backward_matches_autograd() -> None:
    """The block gradients from the merged output and LSE, with the block as the whole row (GQA 4:2)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    do = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    for causal in (True, False):
        out, lse = block_attention(q, k, v, causal, 0.3)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)  # the block computes in fp32
        want = torch.autograd.grad(ref, (q, k, v), do)
        got = block_attention_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), do, causal,
                                       0.3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused_before_any_collective() -> None:
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig
    from lightning_perf.parallel.model_parallel.ring_attention import ring_attention

    with pytest.raises(ValueError, match=r"local length 7 is odd"):
        ring_attention(torch.zeros(1, 2, 7, 8), torch.zeros(1, 2, 7, 8), torch.zeros(1, 2, 7, 8), group=None)
    with pytest.raises(ValueError, match=r"nh % nkv == 0"):
        ring_attention(torch.zeros(1, 3, 8, 8), torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), group=None)
    with pytest.raises(ValueError, match=r"context_parallel_mode='rings' is not one of \('allgather', 'ring'\)"):
        Parallel3DConfig(context_parallel_size=2, context_parallel_mode="rings")
    assert not (dist.is_available() and dist.is_initialized())


def _tiny_gpt():
    from lightning_perf.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(name="t", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    intermediate_size=64, pad_vocab_multiple=16, bias=False, positions="rope", norm="rmsnorm",
                    activation="swiglu", tie_embeddings=False)
    return GPT(cfg)


def _train(model, batches, world: int, group) -> tuple[list[float], dict]:
    """A few AdamW steps; gradients averaged over ``group`` as the strategy does over (dp, cp)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, t in batches:
        loss = model(x, t)
        loss.backward()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= world
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 64, (2, 17), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def _cp2_worker(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.parallel.model_parallel.context_parallel import (
        apply_context_parallel,
        context_parallel_attention,
    )
    from lightning_perf.parallel.model_parallel.ring_attention import ring_attention

    res: dict = {}
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out, ref = causal_gqa_case(g)
    ops = {}
    for name, fn in (("ring", ring_attention), ("allgather", context_parallel_attention)):
        local = [split_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
        y = fn(*local, group=group)
        y.backward(split_sequence(grad_out, world, rank, dim=2))
        ops[name] = [y.detach()] + [t.grad for t in local]
    res["op"] = ops
    res["op_ref"] = [split_sequence(t, world, rank, dim=2) for t in (ref.detach(), q.grad, k.grad, v.grad)]
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    batches = _batches(3)
    for mode in ("ring", "allgather"):
        model = _tiny_gpt()
        apply_context_parallel(model, mesh["cp"], mode)
        res[mode] = _train(model, batches, world, group)
    res["positions"] = load_balanced_positions(16, world, rank).tolist()
    return res


@pytest.mark.slow
def test_ring_under_cp2_equals_one_process_and_allgather(tmp_path) -> None:
    results = spawn(_cp2_worker, 2, tmp_path, timeout=120.0, init_group=True)
    ref_losses, ref_params = _train(_tiny_gpt(), _batches(3), 1, None)
    for r in results:
        for name in ("ring", "allgather"):
            for got, want in zip(r["op"][name], r["op_ref"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} op: {m}")
        for got, want in zip(r["op"]["ring"], r["op"]["allgather"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        losses, params = r["ring"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(r["allgather"][0]), rtol=1e-5, atol=0)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"ring {n}: {m}")
            torch.testing.assert_close(p, r["allgather"][1][n], rtol=1e-4, atol=1e-5)
