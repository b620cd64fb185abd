"""Flash attention forward and backward against plain softmax attention (fp32 reference)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _gpu import ON_GPU

from lightning_perf.kernels import flash_attention
from lightning_perf.kernels.ops.flash_attention import attention_reference, flash_attention_supported


CPU_DTYPES = [(torch.float32, 2e-5, 2e-5), (torch.float16, 3e-3, 3e-3)]
GPU_DTYPES = [(torch.bfloat16, 2e-2, 2e-2), (torch.float16, 4e-3, 4e-3)]

# (B, H, Hkv, T, D): T odd / not a multiple of the 16-row interpreter block, T=1, GQA 2:1 and 4:1, head dims 16-128
CPU_SHAPES = [
    (1, 1, 1, 1, 16),
    (1, 2, 2, 17, 16),
    (2, 2, 1, 33, 32),
    (1, 4, 1, 40, 16),
    (1, 2, 1, 24, 64),
    (1, 1, 1, 19, 128),
]


def _qkv(B, H, HK, T, D, dtype, device, layout="contiguous"):
    gen = torch.Generator().manual_seed(B * 1000 + H * 100 + T + D)

    def rnd(heads):
        if layout == "projection":  # (B, T, h, D) memory viewed as (B, h, T, D)
            t = torch.randn(B, T, heads, D, generator=gen).transpose(1, 2)
        else:
            t = torch.randn(B, heads, T, D, generator=gen)
        return t.to(device=device, dtype=dtype).requires_grad_()

    return rnd(H), rnd(HK), rnd(HK)


def _check(q, k, v, causal, close, atol, rtol, scale=None):
    if q.is_cuda and q.dtype == torch.float32:  # on a GPU, fp32 tiles multiply in tf32 (10-bit mantissa)
        atol, rtol = max(atol, 5e-3), max(rtol, 5e-3)
    out = flash_attention(q, k, v, causal=causal, softmax_scale=scale)
    ref = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    close(out, ref, atol, rtol, "output")
    do = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do)
    for name, g, w in zip("qkv", got, want):
        close(g, w, atol * 4, rtol * 4, f"d{name}")


@pytest.mark.parametrize("dtype,atol,rtol", CPU_DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "B{}H{}kv{}T{}D{}".format(*s))
def test_flash_attention_matches_reference(shape, causal, dtype, atol, rtol, poison, close, device):
    q, k, v = _qkv(*shape, dtype, device)
    _check(q, k, v, causal, close, atol, rtol)


def test_projection_layout_and_custom_scale(poison, close, device):
    q, k, v = _qkv(2, 4, 2, 21, 32, torch.float32, device, layout="projection")
    _check(q, k, v, True, close, 2e-5, 2e-5, scale=0.3)


def test_output_layout_makes_head_merge_free(device):
    q, k, v = _qkv(1, 2, 2, 8, 16, torch.float32, device)
    out = flash_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, D) in memory


def test_large_logits_do_not_overflow(poison, close, device):
    q, k, v = _qkv(1, 2, 2, 20, 16, torch.float32, device)
    with torch.no_grad():
        q.mul_(30.0)  # scores of several hundred: exp() would overflow without the running max
    _check(q, k, v, True, close, 1e-4, 1e-4)


@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
def test_gpu_config_lists_fit_the_causal_loops(D):
    from lightning_perf.kernels.ops import flash_attention_configs as fc

    for kernel in ("fwd", "dq", "dkdv"):
        every = fc._base_configs(kernel, D, True)
        causal = fc.usable_configs(kernel, every, True)
        assert causal and fc.usable_configs(kernel, every, False) == list(every)
        for c in causal:
            small, big = ("BLOCK_M", "BLOCK_N") if kernel == "dkdv" else ("BLOCK_N", "BLOCK_M")
            assert c[big] % c[small] == 0, (kernel, D, c)
    for kernel in ("fwd", "dq", "dkdv", "fused"):  # the lists the launchers use, deep-pipeline extras included
        small, big = ("BLOCK_M", "BLOCK_N") if kernel in ("dkdv", "fused") else ("BLOCK_N", "BLOCK_M")
        for c in fc._configs(kernel, D, True, True):
            assert c[big] % c[small] == 0, (kernel, D, c)


def test_unequal_blocks_and_unusable_first_config(monkeypatch, poison, close, device):
    """Query and key blocks of different sizes (as on the GPU), with a causally unusable config
    listed first: it must be skipped, the others must give the reference on both masks."""
    from lightning_perf.kernels.ops import flash_attention_configs as fc

    cfg, table = fc._cfg, fc._base_configs
    forced = {"fwd": [cfg(16, 32, 4, 1), cfg(32, 16, 4, 1)], "dq": [cfg(16, 32, 4, 1), cfg(32, 16, 4, 1)],
              "dkdv": [cfg(32, 16, 4, 1), cfg(16, 32, 4, 1)]}
    monkeypatch.setattr(fc, "_config_cache", {})
    monkeypatch.setattr(fc, "_base_configs", lambda kernel, D, cuda: forced.get(kernel) or table(kernel, D, cuda))
    q, k, v = _qkv(1, 2, 1, 45, 16, torch.float32, device)
    _check(q, k, v, True, close, 2e-5, 2e-5)
    q, k, v = _qkv(1, 2, 1, 45, 16, torch.float32, device)  # non-causal takes the first configs
    _check(q, k, v, False, close, 2e-5, 2e-5)


_FP32, _FP16 = CPU_DTYPES


@pytest.mark.parametrize("shape,causal,dtype,atol,rtol", [
    ((1, 4, 2, 37, 16), True, *_FP32), ((1, 4, 2, 37, 16), False, *_FP32),
    ((2, 2, 2, 19, 32), True, *_FP16), ((2, 2, 2, 19, 32), False, *_FP32),
], ids=["gqa-T37-causal-fp32", "gqa-T37-full-fp32", "T19-causal-fp16", "T19-full-fp32"])
def test_fused_backward_matches_reference(shape, causal, dtype, atol, rtol, monkeypatch, poison, close, device):
    """The one-pass backward (dQ by atomic adds), which the GPU chooses when it times faster."""
    from lightning_perf.kernels.ops import flash_attention_launch as launch

    monkeypatch.setattr(launch, "_bwd_impls", lambda cuda: [dict(impl="fused")])
    q, k, v = _qkv(*shape, dtype, device, layout="projection")
    _check(q, k, v, causal, close, atol, rtol)


def test_bad_inputs_raise(device):
    q = torch.randn(1, 3, 8, 16, device=device)
    k = torch.randn(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention(q, k, k)
    q = torch.randn(1, 2, 8, 24, device=device)
    with pytest.raises(ValueError, match="head dim 24"):
        flash_attention(q, q, q)
    assert not flash_attention_supported(q, q, q)
    q = torch.randn(1, 2, 8, 16, device=device)
    for scale in (0.0, -0.25, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale must be a positive"):
            flash_attention(q, q, q, softmax_scale=scale)


GPU_SHAPES = [(2, 8, 8, 1000, 64), (1, 16, 4, 2049, 128), (1, 4, 4, 515, 256), (2, 12, 12, 1024, 64),
              (1, 8, 2, 4096, 128)]
# each (head dim tier of the launch configurations, mask, dtype) is a kernel of its own to compile: the GPU run
# takes bf16 at each tier causal (D=128, where real models run, also full), with GQA and odd T; --gpu-slow the rest
_GPU_RUN = {((1, 16, 4, 2049, 128), True), ((1, 16, 4, 2049, 128), False), ((2, 8, 8, 1000, 64), True),
            ((1, 4, 4, 515, 256), True)}


def _gpu_cases():
    for shape in GPU_SHAPES:
        for causal in (True, False):
            for dtype, atol, rtol in GPU_DTYPES:
                default = dtype == torch.bfloat16 and (shape, causal) in _GPU_RUN
                yield pytest.param(shape, causal, dtype, atol, rtol, marks=() if default else pytest.mark.gpu_slow,
                                   id="B{}H{}kv{}T{}D{}".format(*shape) + ("-causal-" if causal else "-full-")
                                   + str(dtype).removeprefix("torch."))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal,dtype,atol,rtol", list(_gpu_cases()))
def test_flash_attention_gpu(shape, causal, dtype, atol, rtol, poison, close):
    q, k, v = _qkv(*shape, dtype, "cuda", layout="projection")
    # compare to an fp32 reference; tolerance from the half-precision inputs, scaled for long rows
    _check(q, k, v, causal, close, atol * math.sqrt(shape[3] / 64), rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["split", "fused"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_both_backwards_gpu(impl, causal, monkeypatch, poison, close, fresh_tuner):
    """Each backward strategy on its own (the tuner runs only the faster one, or the first, in the other tests)."""
    from lightning_perf.kernels.ops import flash_attention_launch as launch

    from lightning_perf.kernels import autotune

    monkeypatch.setattr(launch, "_bwd_impls", lambda cuda: [dict(impl=impl)])
    # a tuner of its own: no choice remembered from another test (or run) can override the forced one
    monkeypatch.setattr(autotune._Default, "tuner", fresh_tuner)
    q, k, v = _qkv(1, 8, 2, 1031, 128, torch.bfloat16, "cuda", layout="projection")
    _check(q, k, v, causal, close, 2e-2 * math.sqrt(2), 2e-2)


def _tma_configs(on_gpu: bool):
    if on_gpu:
        return [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True)]
    return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, TMA=True),
            dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1, TMA=True)]


# the tensor-descriptor (TMA) kernels run on a GPU only through these two tests (the GPU run's tuner takes the
# pointer kernels' first configs): every shape in the interpreter, head dim 128 in the GPU run
TMA_SHAPES = [pytest.param(s, marks=() if s[-1] == 128 else pytest.mark.gpu_slow, id="B{}H{}kv{}T{}D{}".format(*s))
              for s in CPU_SHAPES]


@pytest.mark.gpu(cpu=True)
@pytest.mark.parametrize("layout", ["contiguous", "projection"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", TMA_SHAPES)
def test_tensor_descriptor_forward_matches_reference(shape, causal, layout, poison, close, device):
    """The TMA forward (tiles through 4-D tensor descriptors, tails zero-filled / clipped by the copy
    engine) gives the reference output and the pointer kernel's log-sum-exp, every element written."""
    from lightning_perf.kernels.ops.flash_attention_launch import _tma_usable, flash_attn_fwd

    dtype, atol, rtol = (torch.bfloat16, 2e-2, 2e-2) if ON_GPU else (torch.float32, 2e-5, 2e-5)
    q, k, v = (t.detach() for t in _qkv(*shape, dtype, device, layout))
    if not _tma_usable(q, k, v):
        pytest.skip("tensor descriptors unavailable for this input / device")
    scale = 1.0 / math.sqrt(shape[-1])
    ref = attention_reference(q, k, v, causal=causal)
    _, lse_ptr = flash_attn_fwd(q, k, v, causal, scale, config=dict(_tma_configs(ON_GPU)[0], TMA=False))
    for cfg in _tma_configs(ON_GPU):
        out, lse = flash_attn_fwd(q, k, v, causal, scale, config=cfg)
        close(out, ref, atol, rtol, f"output {cfg}")
        close(lse, lse_ptr, 1e-4, 1e-4, f"lse {cfg}")


def test_tensor_descriptor_config_refused_on_misaligned_input(device):
    from lightning_perf.kernels.ops.flash_attention_launch import flash_attn_fwd

    base = torch.randn(1 * 2 * 9 * 16 + 1, device=device)[1:]  # 4-byte offset: not 16-byte aligned
    q = base.view(1, 2, 9, 16)
    with pytest.raises(ValueError, match="tensor descriptors"):
        flash_attn_fwd(q, q, q, True, 0.25, config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, TMA=True))


@pytest.mark.gpu(cpu=True)
@pytest.mark.parametrize("layout", ["contiguous", "projection"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", TMA_SHAPES)
def test_tensor_descriptor_dkdv_matches_reference(shape, causal, layout, poison, close, device):
    """The dK/dV kernel through tensor descriptors (GQA heads looped per key block) gives the
    reference gradients; dQ from the pointer kernel beside it."""
    from lightning_perf.kernels.ops.flash_attention_launch import _tma_usable, flash_attn_bwd, flash_attn_fwd

    dtype, atol, rtol = (torch.bfloat16, 2e-2, 2e-2) if ON_GPU else (torch.float32, 2e-5, 2e-5)
    q, k, v = _qkv(*shape, dtype, device, layout)
    if not _tma_usable(q.detach(), k.detach(), v.detach()):
        pytest.skip("tensor descriptors unavailable for this input / device")
    scale = 1.0 / math.sqrt(shape[-1])
    ref = attention_reference(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = flash_attn_fwd(qd, kd, vd, causal, scale)
    for cfg in ([dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3, TMA=True)] if ON_GPU else
                [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, TMA=True),
                 dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1, TMA=True)]):
        got = flash_attn_bwd(qd, kd, vd, o, lse, do.contiguous(), causal, scale, dkdv_config=cfg)
        for name, g, w in zip("qkv", got, want):
            close(g, w, atol * 4, rtol * 4, f"d{name} {cfg}")


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "math"])
def test_ring_blocks_merge_by_lse_into_causal_attention(use_triton, close, device):
    """What ring attention asks of a block: the LSE of the kernel's forward merges the outputs of
    key blocks, and its backward given the merged output and LSE gives each block's share of the
    gradients. Queries of the second half see the first key half in full and the second causally."""
    from lightning_perf.parallel.model_parallel.ring_attention import block_attention, block_attention_backward

    q, k, v = _qkv(1, 4, 2, 32, 16, torch.float32, device)
    ref = attention_reference(q, k, v, causal=True)
    do = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), do)
    scale = 0.25
    (q0, q1), (k0, k1), (v0, v1) = (t.detach().chunk(2, dim=2) for t in (q, k, v))
    o0, l0 = block_attention(q0, k0, v0, True, scale, use_triton)
    o_a, l_a = block_attention(q1, k0, v0, False, scale, use_triton)
    o_b, l_b = block_attention(q1, k1, v1, True, scale, use_triton)
    l1 = torch.logaddexp(l_a, l_b)
    o1 = o_a * (l_a - l1).exp().unsqueeze(-1) + o_b * (l_b - l1).exp().unsqueeze(-1)
    out = torch.cat([o0, o1], dim=2)
    close(out, ref.detach(), 2e-5, 2e-5, "merged output")
    o0, o1 = o0.to(q.dtype), o1.to(q.dtype)
    do0, do1 = do.chunk(2, dim=2)
    dq0, dk0, dv0 = block_attention_backward(q0, k0, v0, o0, l0, do0, True, scale, use_triton)
    dq1a, dk0a, dv0a = block_attention_backward(q1, k0, v0, o1, l1, do1, False, scale, use_triton)
    dq1b, dk1, dv1 = block_attention_backward(q1, k1, v1, o1, l1, do1, True, scale, use_triton)
    got = (torch.cat([dq0, dq1a + dq1b], dim=2), torch.cat([dk0 + dk0a, dk1], dim=2),
           torch.cat([dv0 + dv0a, dv1], dim=2))
    for name, g, w in zip("qkv", got, want):
        close(g, w, 1e-4, 1e-4, f"d{name}")


@pytest.mark.parametrize("mode, forwards_in_backward", [("selective", 0), ("full", 1)])
def test_selective_checkpointing_keeps_the_attention(mode, forwards_in_backward, monkeypatch, close, device):
    """Selective activation checkpointing keeps the Triton attention's output and LSE, as it keeps SDPA's:
    the backward's recomputation of the block runs no attention forward (full checkpointing runs one)."""
    import lightning_perf.kernels.ops.flash_attention as fa
    from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing

    calls = {"forward": 0}
    forward = fa.flash_attn_fwd

    def counted(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(fa, "flash_attn_fwd", counted)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 3 * 16, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, T, 16) -> same
            q, k, v = self.proj(x).chunk(3, dim=-1)
            return flash_attention(q.tanh(), k, v, causal=True) * 2

    torch.manual_seed(0)
    block = Block().to(device)
    reference = copy.deepcopy(block)
    apply_activation_checkpointing([block], mode)
    x = torch.randn(1, 2, 24, 16, device=device)
    y = block(x)
    assert calls["forward"] == 1
    y.square().sum().backward()
    assert calls["forward"] == 1 + forwards_in_backward
    reference(x).square().sum().backward()
    close(block.proj.weight.grad, reference.proj.weight.grad, 1e-5, 1e-5, "dW")
