"""Context parallelism's pieces: the load-balanced split (numbers only), the attention over a cp2
group against full causal attention, and a GPT under cp2 against the same GPT in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _attention_case import causal_gqa_case
from _spawn import spawn

from lightning_perf.parallel.model_parallel.context_parallel import (
    _global_order,
    check_context_parallel_seq_len,
    load_balanced_positions,
    split_sequence,
)


def test_rank_r_holds_chunks_r_and_mirror() -> None:
    # T = 16, cp = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # cp = 4, T = 8: one token per chunk, rank r holds r and 7 - r
    assert [load_balanced_positions(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("T, cp", [(16, 2), (24, 3), (32, 4)])
def test_split_covers_the_sequence_with_equal_causal_work(T: int, cp: int) -> None:
    parts = [load_balanced_positions(T, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(T))
    # a query at position t attends to t + 1 keys: every rank the same number of (query, key) pairs
    work = {int((p + 1).sum()) for p in parts}
    assert work == {T * (T + 1) // (2 * cp)}
    x = torch.arange(2 * 3 * T).view(2, 3, T)
    splits = [split_sequence(x, cp, r, dim=2) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(splits[r], x[:, :, parts[r]])
    assert torch.equal(_global_order(splits, dim=2), x)


def test_sequence_not_divisible_by_two_cp_is_refused() -> None:
    check_context_parallel_seq_len(20, 1)  # no context parallelism: anything goes
    with pytest.raises(ValueError, match=r"2 \* cp = 4 chunks .*seq_len=18 / 4 = 4.5; use a seq_len divisible by 4"):
        check_context_parallel_seq_len(18, 2)
    with pytest.raises(ValueError, match="seq_len=20 / 8"):
        split_sequence(torch.zeros(1, 20), 4, 0)
    with pytest.raises(ValueError, match=r"cp rank 2 is outside 0..1"):
        load_balanced_positions(16, 2, 2)
    assert not (dist.is_available() and dist.is_initialized())


def _tiny_gpt(positions: str):
    from lightning_perf.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    kw = dict(norm="rmsnorm", activation="swiglu", tie_embeddings=False) if positions == "rope" else {}
    cfg = GPTConfig(name="t", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2 if positions == "rope"
                    else 4, n_embd=32, intermediate_size=64, pad_vocab_multiple=16, bias=False, positions=positions,
                    **kw)
    return GPT(cfg)


def _cp2_worker(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.parallel.model_parallel.context_parallel import (
        apply_context_parallel,
        context_parallel_attention,
    )

    group = dist.group.WORLD
    res: dict = {}
    # the op: GQA (4 query heads, 2 kv heads), T = 16, against SDPA's causal attention on the whole sequence
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out, ref = causal_gqa_case(g)
    local = [split_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    y = context_parallel_attention(*local, group=group)
    y.backward(split_sequence(grad_out, world, rank, dim=2))
    res["op"] = [(y, split_sequence(ref, world, rank, dim=2))] + [
        (a.grad, split_sequence(b.grad, world, rank, dim=2)) for a, b in zip(local, (q, k, v))]
    # the GPT (rotary + GQA, and learned positions): loss and every parameter's gradient, logits
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    idx = torch.randint(0, 64, (2, 17), generator=g)
    x, t = idx[:, :-1], idx[:, 1:].clone()
    t[0, 2] = t[1, 13] = -100  # ignored targets, unevenly over the ranks
    for positions in ("rope", "learned"):
        full, model = _tiny_gpt(positions), _tiny_gpt(positions)
        ref_loss = full(x, t)
        ref_loss.backward()
        seen: list[int] = []
        model.blocks["0"].attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
        apply_context_parallel(model, mesh["cp"])
        loss = model(x, t)
        loss.backward()
        for p in model.parameters():  # what the strategy does after backward: average over the cp ranks
            dist.all_reduce(p.grad)
            p.grad /= world
        grads = {n: (p.grad, full.get_parameter(n).grad) for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = (model(x), full(x))
        res[positions] = {"loss": (loss.detach(), ref_loss.detach()), "grads": grads, "logits": logits,
                          "seen": list(seen)}
    # every target of cp rank 0's tokens ignored: the loss is rank 1's mean alone, gradients finite
    t0 = t.clone()
    t0[:, load_balanced_positions(16, world, 0)] = -100
    full.zero_grad()
    model.zero_grad()
    ref_loss = full(x, t0)
    ref_loss.backward()
    loss = model(x, t0)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    res["rank0_ignored"] = {"loss": (loss.detach(), ref_loss.detach()),
                            "grads": {n: (p.grad, full.get_parameter(n).grad) for n, p in model.named_parameters()}}
    return res


@pytest.mark.slow
def test_attention_and_gpt_under_cp2_equal_one_process(tmp_path) -> None:
    results = spawn(_cp2_worker, 2, tmp_path, timeout=120.0, init_group=True)
    for r in results:
        for got, want in r["op"]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for positions in ("rope", "learned"):
            res = r[positions]
            assert res["seen"] == [8, 8], res["seen"]  # both forwards ran on this rank's 8 of the 16 tokens
            torch.testing.assert_close(*res["loss"], rtol=1e-5, atol=0)
            torch.testing.assert_close(*res["logits"], rtol=1e-5, atol=1e-6)
            for name, (got, want) in res["grads"].items():
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{positions} {name}: {m}")
        res = r["rank0_ignored"]
        torch.testing.assert_close(*res["loss"], rtol=1e-5, atol=0)
        for name, (got, want) in res["grads"].items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank 0 ignored, {name}: {m}")


@pytest.mark.gpu(cpu=True)
def test_bottom_right_causal_attention_equals_the_last_rows_of_full_causal() -> None:
    """The all-gather mode's per-chunk attention: queries that are the last ``Tq`` of ``Tk`` positions
    (GQA 4:2), forward and gradients, against the same rows of causal SDPA over all ``Tk`` queries.
    On the CPU the mask is built; on a GPU in bf16 SDPA's flash kernel takes it (checked)."""
    import torch.nn.functional as F
    from _gpu import ON_GPU

    from lightning_perf.parallel.model_parallel.context_parallel import _causal_lower_right, _flash_lower_right

    device, dtype = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    Tk, hd = 96, 64
    q_all = torch.randn(2, 4, Tk, hd, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(2, 2, Tk, hd, generator=g, device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn(2, 4, Tk, hd, generator=g, device=device, dtype=dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if ON_GPU else dict(rtol=1e-5, atol=1e-6)
    for Tq in (32, 64, 96):
        q = q_all[:, :, Tk - Tq:].clone().requires_grad_()
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        assert _flash_lower_right(q) == ON_GPU
        y = _causal_lower_right(q, kk, vv)
        y.backward(grad[:, :, Tk - Tq:])
        # reference: every query, causal from the top left; the last Tq rows are the ones wanted
        ref_q = q_all.clone().requires_grad_()
        rk, rv = k.clone().requires_grad_(), v.clone().requires_grad_()
        ref = F.scaled_dot_product_attention(ref_q, rk, rv, is_causal=True, enable_gqa=True)
        mask = torch.zeros_like(grad)
        mask[:, :, Tk - Tq:] = 1
        ref.backward(grad * mask)
        torch.testing.assert_close(y, ref[:, :, Tk - Tq:], **tol)
        torch.testing.assert_close(q.grad, ref_q.grad[:, :, Tk - Tq:], **tol)
        torch.testing.assert_close(kk.grad, rk.grad, **tol)
        torch.testing.assert_close(vv.grad, rv.grad, **tol)
