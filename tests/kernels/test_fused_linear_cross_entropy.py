"""Fused linear + cross-entropy against full-logits cross-entropy (fp32), loss and both gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.kernels import fused_linear_cross_entropy
from lightning_perf.kernels.ops import fused_linear_cross_entropy as flce_module
from lightning_perf.kernels.ops.fused_linear_cross_entropy import linear_cross_entropy_reference


CPU_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 1e-2, 1e-2)]
# (token shape, hidden, vocab): vocab not a multiple of the block, tiny and wide hidden sizes, 3-D input
SHAPES = [((1,), 8, 5), ((21,), 16, 300), ((3, 11), 4, 97), ((20,), 96, 64)]


def _make(tokens, d, V, dtype, device, ignore_every=3):
    gen = torch.Generator().manual_seed(d * V)
    x = torch.randn(*tokens, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(V, d, generator=gen) / d**0.5).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, tokens, generator=gen)
    if ignore_every and t.numel() > 1:
        t.view(-1)[::ignore_every] = -100
    return x, w, t.to(device)


def _check(x, w, t, close, atol, rtol, **kw):
    loss = fused_linear_cross_entropy(x, w, t, **kw)
    ref = linear_cross_entropy_reference(x.float(), w.float(), t, **kw)
    close(loss, ref, atol, rtol, "loss")
    g = torch.rand_like(ref) + 0.5
    got = torch.autograd.grad(loss, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g)
    for name, a, b in zip(("dx", "dW"), got, want):
        assert a.dtype == (x if name == "dx" else w).dtype
        close(a, b.to(a.dtype), atol, rtol, name)


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}d{s[1]}V{s[2]}")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(shape, reduction, dtype, atol, rtol, poison, close, device, monkeypatch):
    tokens, d, V = shape
    # several chunks even at these sizes: 4 rows of logits per chunk
    monkeypatch.setattr(flce_module, "_CHUNK_BYTES", 4 * V * dtype.itemsize)
    monkeypatch.setattr(flce_module, "_MIN_CHUNK_ROWS", 4)
    x, w, t = _make(tokens, d, V, dtype, device)
    _check(x, w, t, close, atol, rtol, reduction=reduction)


@pytest.mark.gpu(cpu=True)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_first_call_of_a_key_is_right_when_the_tuner_relaunches(reduction, relaunching_tuner, poison, close, device,
                                                                 monkeypatch):
    """The loss kernel overwrites the logits with their gradient; a tuner launching it several times on the
    chunk itself (a key's first call on a GPU) would turn the logits into gradients: loss ~ log V, wrong grads."""
    monkeypatch.setattr(flce_module, "_CHUNK_BYTES", 8 * 300 * 4)
    monkeypatch.setattr(flce_module, "_MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(flce_module, "_TUNE_ROWS", 4)  # the tuner's copy is smaller than a chunk
    x, w, t = _make((21,), 16, 300, torch.float32, device)
    _check(x, w, t, close, 1e-5, 1e-5, reduction=reduction)


@pytest.mark.parametrize("z_loss", [1e-4, 0.1])
def test_z_loss_and_ignore_index(z_loss, poison, close, device):
    x, w, t = _make((29,), 16, 50, torch.float32, device, ignore_every=2)
    t = torch.where(t == -100, torch.full_like(t, 7), t)  # a custom ignore index
    t.view(-1)[::5] = 7
    _check(x, w, t, close, 1e-5, 1e-5, z_loss=z_loss, ignore_index=7)


def test_frozen_weight_gets_no_grad(poison, close, device):
    x, w, t = _make((9,), 8, 40, torch.float32, device)
    w.requires_grad_(False)
    loss = fused_linear_cross_entropy(x, w, t)
    (dx,) = torch.autograd.grad(loss, (x,))
    (ref_dx,) = torch.autograd.grad(linear_cross_entropy_reference(x, w, t), (x,))
    close(dx, ref_dx, 1e-5, 1e-5, "dx")


def test_bad_arguments_raise(device):
    x, w, t = _make((4,), 8, 10, torch.float32, device)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="weight"):
        fused_linear_cross_entropy(x, w[:, :4], t)


@pytest.mark.gpu
@pytest.mark.parametrize("V,d", [(50304, 768), (128256, 2048)])
def test_bf16_autocast_gpu(V, d, poison, close):
    """Under bf16 autocast the matmuls run in bf16 like the plain path; compare to its fp32 logits."""
    x, w, t = _make((4096,), d, V, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, t)
    ref = linear_cross_entropy_reference(x.bfloat16().float(), w.bfloat16().float(), t)
    close(loss, ref, 1e-3, 1e-3, "loss")
    got = torch.autograd.grad(loss, (x, w))
    want = torch.autograd.grad(ref, (x, w))
    for name, a, b in zip(("dx", "dW"), got, want):
        err = (a.float() - b).norm() / b.norm()
        assert err < 2e-2, f"{name}: relative error {err:.3e}"
