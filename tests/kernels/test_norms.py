"""RMSNorm and LayerNorm (with and without the fused residual add) against their references."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.kernels import LayerNorm, RMSNorm, layer_norm, rms_norm
from lightning_perf.kernels.ops.layer_norm import layer_norm_reference
from lightning_perf.kernels.ops.rms_norm import rms_norm_reference


CPU_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 3e-3, 3e-3)]
GPU_DTYPES = [(torch.bfloat16, 3e-2, 2e-2), (torch.float16, 4e-3, 4e-3)]
# (rows..., hidden): tiny and odd hidden sizes (hidden 1 is degenerate for LayerNorm: zero variance), a non power of two, rows not a multiple of the block
SHAPES = [(1, 2), (3, 7), (5, 64), (2, 3, 100), (9, 256)]


def _make(shape, dtype, device, with_bias, with_residual):
    gen = torch.Generator().manual_seed(sum(shape))

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(s, generator=gen) * scale + shift).to(device=device, dtype=dtype).requires_grad_()

    N = shape[-1]
    x = rnd(*shape, scale=2.0, shift=0.5)
    w = rnd(N, scale=0.5, shift=1.0)
    b = rnd(N, scale=0.5) if with_bias else None
    r = rnd(*shape) if with_residual else None
    return x, w, b, r


def _compare(out, expected, inputs, close, atol, rtol, name):
    out = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for i, (o, e) in enumerate(zip(out, expected)):
        close(o, e, atol, rtol, f"{name} output {i}")
    grads = [torch.randn_like(e) for e in expected]
    got = torch.autograd.grad(out, inputs, grads)
    want = torch.autograd.grad(expected, inputs, grads)
    for i, (g, w) in enumerate(zip(got, want)):
        # dw sums over all rows: scale the tolerance with the magnitude
        close(g, w, atol * 8, rtol * 8, f"{name} grad {i}")


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(shape, residual, dtype, atol, rtol, poison, close, device):
    x, w, _, r = _make(shape, dtype, device, False, residual)
    inputs = [x, w] + ([r] if residual else [])
    _compare(rms_norm(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r), inputs, close, atol, rtol, "rms_norm")


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_layer_norm_matches_reference(shape, bias, residual, dtype, atol, rtol, poison, close, device):
    x, w, b, r = _make(shape, dtype, device, bias, residual)
    inputs = [x, w] + ([b] if bias else []) + ([r] if residual else [])
    _compare(layer_norm(x, w, b, 1e-5, r), layer_norm_reference(x, w, b, 1e-5, r), inputs, close, atol, rtol,
             "layer_norm")


def test_norm_modules_and_non_contiguous_input(poison, close, device):
    x = torch.randn(6, 4, 48, device=device).transpose(0, 1)  # non-contiguous rows
    ln, rn = LayerNorm(48).to(device), RMSNorm(48).to(device)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-0.5, 0.5), rn.weight.uniform_(0.5, 1.5)
    close(ln(x), layer_norm_reference(x, ln.weight, ln.bias, ln.eps), 1e-5, 1e-5, "LayerNorm module")
    close(rn(x), rms_norm_reference(x, rn.weight, rn.eps), 1e-5, 1e-5, "RMSNorm module")


def test_bad_shapes_raise(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"expected \(8,\)"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="residual"):
        layer_norm(x, torch.ones(8, device=device), None, 1e-5, torch.randn(2, 9, device=device))


# each (hidden size's power-of-two block, dtype) compiles its own kernels: the GPU run takes a small and the
# widest block in bf16 (both sizes not powers of two) and one in fp16; --gpu-slow every pair
_GPU_RUN = {(768, torch.bfloat16), (5120, torch.bfloat16), (4096, torch.float16)}


@pytest.mark.gpu
@pytest.mark.parametrize("N,dtype,atol,rtol", [
    pytest.param(N, *tol, marks=() if (N, tol[0]) in _GPU_RUN else pytest.mark.gpu_slow,
                 id=f"{N}-{str(tol[0]).removeprefix('torch.')}")
    for N in (768, 2048, 4096, 5120) for tol in GPU_DTYPES])
def test_norms_gpu(N, dtype, atol, rtol, poison, close):
    x, w, b, r = _make((4099, N), dtype, "cuda", True, True)
    _compare(layer_norm(x, w, b, 1e-5, r), layer_norm_reference(x, w, b, 1e-5, r), [x, w, b, r], close, atol, rtol,
             "layer_norm")
    _compare(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), [x, w], close, atol, rtol, "rms_norm")


# on a GPU the only run of the prefetching and pipelined loops (the GPU run's tuner takes the first, plain
# config): every loop on the layer norm with a residual there, the other variants with --gpu-slow
@pytest.mark.gpu(cpu=True)
@pytest.mark.parametrize("prefetch,stages", [(False, 0), (True, 0), (False, 3)],
                         ids=["plain-loop", "prefetch", "pipelined"])
@pytest.mark.parametrize("residual", [pytest.param(False, marks=pytest.mark.gpu_slow, id="plain"),
                                      pytest.param(True, id="residual")])
@pytest.mark.parametrize("bias", [pytest.param(True, id="layernorm"),
                                  pytest.param(False, marks=pytest.mark.gpu_slow, id="rmsnorm")])
def test_norm_backward_loops_match_reference(prefetch, stages, residual, bias, monkeypatch, poison, close, device):
    """Every backward loop (rows loaded in step, the next rows prefetched into registers during
    this step's reductions, or loads pipelined by the compiler through shared memory), with bands
    whose row count is not a multiple of BLOCK_M, gives the reference."""
    from lightning_perf.kernels.ops import _row_norm

    monkeypatch.setattr(_row_norm, "_bwd_configs",
                        lambda block_n, cuda, rows_bucket: (dict(BLOCK_M=2, num_warps=4, PROGRAMS_PER_SM=1,
                                                                 PREFETCH=prefetch, STAGES=stages),))
    monkeypatch.setattr(_row_norm, "num_sms", lambda dev: 3)  # 3 programs: bands of 13, 13, 11 rows
    dtype, atol, rtol = (torch.bfloat16, 2e-2, 2e-2) if device == "cuda" else (torch.float32, 1e-5, 1e-5)
    x, w, b, r = _make((37, 40), dtype, device, bias, residual)
    inputs = [x, w] + ([b] if bias else []) + ([r] if residual else [])
    if bias:
        out, ref = layer_norm(x, w, b, 1e-5, r), layer_norm_reference(x, w, b, 1e-5, r)
    else:
        out, ref = rms_norm(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r)
    _compare(out, ref, inputs, close, atol, rtol, f"prefetch={prefetch} stages={stages}")
