"""SwiGLU, GELU-tanh (plain and gated) and rotary embedding against their references, fwd + bwd."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.kernels import gelu_tanh, gelu_tanh_mul, rotary_embedding, swiglu
from lightning_perf.kernels.ops.gelu import gelu_tanh_mul_reference, gelu_tanh_reference
from lightning_perf.kernels.ops.rotary import rotary_embedding_reference
from lightning_perf.kernels.ops.swiglu import swiglu_reference
from lightning_perf.models.gpt.model import apply_rope, rope_cache


# (dtype, atol, rtol): interpreter-safe dtypes on CPU; bf16 only on the GPU (silently wrong in the interpreter)
CPU_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 2e-3, 2e-3)]
GPU_DTYPES = [(torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-3, 2e-3)]
SHAPES = [(1,), (7,), (3, 37), (2, 5, 129), (1, 1000)]  # odd sizes, not multiples of the block


def _inputs(shape, dtype, device, n, scale=2.0):
    gen = torch.Generator().manual_seed(sum(shape) + n)
    return [(torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_() for _ in range(n)]


def _check_fwd_bwd(fn, ref, inputs, close, atol, rtol, name):
    out = fn(*inputs)
    expected = ref(*inputs)
    close(out, expected, atol, rtol, f"{name} forward")
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(expected, inputs, grad)
    for i, (g, w) in enumerate(zip(got, want)):
        close(g, w, atol * 4, rtol * 4, f"{name} grad {i}")


CASES = [
    ("swiglu", swiglu, swiglu_reference, 2),
    ("gelu_tanh", gelu_tanh, gelu_tanh_reference, 1),
    ("gelu_tanh_mul", gelu_tanh_mul, gelu_tanh_mul_reference, 2),
]


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,fn,ref,n", CASES, ids=[c[0] for c in CASES])
def test_activation_matches_reference(name, fn, ref, n, shape, dtype, atol, rtol, poison, close, device):
    _check_fwd_bwd(fn, ref, _inputs(shape, dtype, device, n), close, atol, rtol, name)


def test_gelu_extreme_inputs_stay_finite(poison, close, device):
    x = torch.tensor([-60.0, -12.0, -3.0, 0.5, 3.0, 12.0, 60.0], device=device, requires_grad=True)
    _check_fwd_bwd(gelu_tanh, gelu_tanh_reference, [x], close, 1e-5, 1e-5, "gelu extreme")


def test_mismatched_shapes_raise(device):
    with pytest.raises(ValueError, match="one shape"):
        swiglu(torch.randn(3, 4, device=device), torch.randn(3, 5, device=device))
    with pytest.raises(ValueError, match="one shape"):
        gelu_tanh_mul(torch.randn(3, 4, device=device), torch.randn(4, 3, device=device))


# ---- rotary ------------------------------------------------------------------------------------

ROPE_SHAPES = [(1, 1, 1, 16), (2, 3, 17, 8), (1, 4, 33, 64), (2, 2, 5, 128)]  # (B, H, T, hd)


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "projection"])
def test_rotary_matches_model_rope(shape, layout, dtype, atol, rtol, poison, close, device):
    B, H, T, D = shape
    cos, sin = rope_cache(T + 3, D, 10000.0, torch.device(device))  # table longer than T
    gen = torch.Generator().manual_seed(T * D)
    if layout == "projection":  # (B, T, H, D) viewed as (B, H, T, D), as the attention module does
        x = torch.randn(B, T, H, D, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(B, H, T, D, generator=gen).to(device=device, dtype=dtype)
    x.requires_grad_()
    # the model's own apply_rope is the contract; the fp32 reference must agree with it too
    close(rotary_embedding_reference(x, cos, sin), apply_rope(x, cos, sin), atol, rtol, "reference vs apply_rope")
    _check_fwd_bwd(lambda t: rotary_embedding(t, cos, sin), lambda t: apply_rope(t, cos, sin), [x], close, atol,
                   rtol, "rotary")


def test_rotary_rejects_bad_tables(device):
    x = torch.randn(1, 2, 8, 16, device=device)
    cos, sin = rope_cache(4, 16, 10000.0, torch.device(device))
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_embedding(x, cos, sin)


# ---- GPU: bf16 and large shapes ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("name,fn,ref,n", CASES, ids=[c[0] for c in CASES])
def test_activation_gpu(name, fn, ref, n, dtype, atol, rtol, poison, close):
    _check_fwd_bwd(fn, ref, _inputs((4096, 2752), dtype, "cuda", n), close, atol, rtol, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
def test_rotary_gpu(dtype, atol, rtol, poison, close):
    B, H, T, D = 2, 16, 1031, 128
    cos, sin = rope_cache(T, D, 500000.0, torch.device("cuda"))
    x = torch.randn(B, T, H, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    _check_fwd_bwd(lambda t: rotary_embedding(t, cos, sin), lambda t: rotary_embedding_reference(t, cos, sin), [x],
                   close, atol, rtol, "rotary")


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
def test_rotary_in_place_on_a_projection_view(dtype, atol, rtol, monkeypatch, close, device):
    """In place on q straight from its projection: same storage, the reference's values and
    gradients; a tuner that launches several times (as on the GPU) must not rotate x more than once."""
    from lightning_perf.kernels.ops import rotary

    B, T, H, D = 2, 13, 3, 16
    cos, sin = rope_cache(T, D, 10000.0, torch.device(device))
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(B, T, H * D, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    real_pick = rotary.default_tuner().pick

    def pick_after_three_launches(kernel, key, configs, launch, dev):
        for _ in range(3):
            launch(configs[0])
        return real_pick(kernel, key, configs, launch, dev)

    monkeypatch.setattr(rotary.default_tuner(), "pick", pick_after_three_launches)

    def projected():
        return (base * 1.5).view(B, T, H, D).transpose(1, 2)  # a non-leaf view, as in the attention module

    x = projected()
    y = rotary_embedding(x, cos, sin, inplace=True)
    assert y.data_ptr() == x.data_ptr()
    ref = apply_rope(projected(), cos, sin)
    close(y, ref, atol, rtol, "in-place output")
    g = torch.randn(ref.shape, generator=gen).to(device=device, dtype=dtype)
    got = torch.autograd.grad(y, base, g)[0]
    want = torch.autograd.grad(ref, base, g)[0]
    close(got, want, atol, rtol, "gradient through the in-place rotation")
    leaf = torch.randn(B, H, T, D, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    before = leaf.detach().clone()
    out = rotary_embedding(leaf, cos, sin, inplace=True)  # a leaf that requires grad: never in place
    assert out.data_ptr() != leaf.data_ptr() and torch.equal(leaf.detach(), before)
