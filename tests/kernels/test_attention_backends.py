"""The attention backends against SDPA: FlexAttention (causal block mask, GQA), the flash-attention
packages' layout and GQA through stand-in modules, what each needs installed."""

from __future__ import annotations

import types

import pytest
import torch

from lightning_perf.kernels import attention_backends as ab
from lightning_perf.kernels.attention_backends import AttentionBackends, expand_kv, missing_requirement, sdpa
from lightning_perf.models.gpt import GPTConfig

# (B, nh, nkv, T, hd): multi-head, grouped-query 4:2 and 6:1, a T that is no multiple of a block
SHAPES = [(2, 2, 2, 16, 16), (1, 4, 2, 37, 16), (2, 6, 1, 70, 8)]


def _qkv(B, nh, nkv, T, hd, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, hd, generator=gen).to(device).requires_grad_() for n in (nh, nkv, nkv)]


def _reference(q, k, v, causal):
    """Plain softmax attention with k / v repeated to every query head, in float64."""
    k, v = (t.double().repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).to(q.dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_h{}_kv{}_T{}_d{}".format(*s))
def test_flex_matches_sdpa(shape, causal, close, device, flex_backward_on_cpu):
    """Output and the gradients of q, k and v equal SDPA's (and a float64 reference's), fp32."""
    q, k, v = _qkv(*shape, device)
    backends = AttentionBackends(compile_flex=False)  # eager flex: the same maths, no compile on CPU
    out = backends("flex", q, k, v, causal)
    ref = sdpa(q, k, v, causal)
    close(out, ref, 1e-5, 1e-5, "flex output vs SDPA")
    close(out, _reference(q, k, v, causal), 1e-5, 1e-5, "flex output vs float64 reference")
    dy = torch.randn_like(out)
    for name, g, r in zip("qkv", torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        close(g, r, 1e-5, 1e-5, f"flex grad of {name}")


def test_flex_block_mask_is_built_once_per_length_and_device(device):
    backends = AttentionBackends(compile_flex=False)
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 24, 16, device))
    backends("flex", q, k, v, True)
    mask = backends.block_mask(24, q.device)
    backends("flex", q, k, v, True)
    assert backends.block_mask(24, q.device) is mask and list(backends._block_masks) == [(24, str(q.device))]
    backends("flex", q[:, :, :16], k[:, :, :16], v[:, :, :16], True)
    assert set(backends._block_masks) == {(24, str(q.device)), (16, str(q.device))}
    assert tuple(mask.shape[-2:]) == (24, 24)


def test_compiled_flex_forward_matches_sdpa(close, device):
    """The compiled path the selector times and runs (forward: on CPU torch compiles no backward).
    Compiled FlexAttention on CPU is wrong at some lengths in torch 2.13 (8, 40, 56 of 1-79); the
    library never runs it there (CPU falls back to SDPA), so this checks lengths it gets right."""
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 37, 16, device, seed=3))
    torch._dynamo.reset()
    out = AttentionBackends()("flex", q, k, v, True)
    close(out, sdpa(q, k, v, True), 1e-5, 1e-5, "compiled flex")


def test_expand_kv_and_pinned_sdpa(close, device):
    q, k, v = _qkv(1, 6, 2, 12, 8, device)
    ke, ve = expand_kv(q, k, v)
    assert ke.shape == (1, 6, 12, 8)
    for h in range(6):  # query head h reads kv head h // 3
        assert torch.equal(ke[:, h], k[:, h // 3]) and torch.equal(ve[:, h], v[:, h // 3])
    assert expand_kv(q, ke, ve)[0] is ke
    if device == "cpu":  # CPU SDPA has the flash backend (and math), pinned by name
        close(sdpa(q, k, v, True, "flash"), _reference(q, k, v, True), 1e-5, 1e-5, "sdpa pinned to flash")


class _StandInFlashAttn(types.ModuleType):
    """``flash_attn_func`` with the flash-attention packages' contract: q (B, T, nh, hd), k / v
    (B, T, nkv, hd), native GQA; returns ``(out, lse)`` like FA4 (and older FA3 builds) or ``out``."""

    def __init__(self, returns_tuple: bool) -> None:
        super().__init__("stand_in_flash_attn")
        self.returns_tuple, self.calls = returns_tuple, []

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False, **_):
        B, T, nh, hd = q.shape
        assert k.shape[:2] == (B, T) and nh % k.shape[2] == 0, (q.shape, k.shape)
        assert q.stride(-1) == 1, "the packages need the head dim contiguous"
        self.calls.append((tuple(q.shape), tuple(k.shape), causal))
        out = _reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal).transpose(1, 2)
        return (out, None) if self.returns_tuple else out


@pytest.mark.parametrize("name,returns_tuple", [("fa3", False), ("fa3", True), ("fa4", True)])
def test_flash_attn_packages_get_their_layout(name, returns_tuple, close):
    """q (B, nh, T, hd) reaches the package as (B, T, nh, hd) with the kv heads unexpanded, and comes
    back as (B, nh, T, hd); a GPT's q (a transposed projection) goes both ways without a copy."""
    backends = AttentionBackends()
    stand_in = backends._modules[name] = _StandInFlashAttn(returns_tuple)
    B, T, nh, nkv, hd = 2, 10, 4, 2, 8
    proj = torch.randn(B, T, nh * hd)
    q = proj.view(B, T, nh, hd).transpose(1, 2)  # as the GPT builds it
    k, v = (torch.randn(B, T, nkv, hd).transpose(1, 2) for _ in range(2))
    out = backends(name, q, k, v, True)
    assert stand_in.calls == [((B, T, nh, hd), (B, T, nkv, hd), True)]
    close(out, _reference(q, k, v, True), 1e-5, 1e-5, f"{name} through the stand-in")
    assert out.shape == (B, nh, T, hd)


def test_unsupported_reasons():
    backends = AttentionBackends()
    q = torch.randn(1, 2, 8, 16)
    for name in ("fa3", "fa4"):
        assert "CUDA" in backends.unsupported(name, q, q, q)
    assert backends.unsupported("flash", q, q, q) is None and backends.unsupported("flex", q, q, q) is None
    odd = torch.randn(1, 2, 8, 24)
    assert "flash_attention" in backends.unsupported("triton", odd, odd, odd)  # head dim 24
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        backends("xformers", q, q, q, True)


def test_missing_requirement_names_the_package(monkeypatch):
    monkeypatch.setattr(ab, "_spec_exists", lambda name: False)
    assert "flash-attn-4" in missing_requirement("fa4")
    assert "flash-attn-3" in missing_requirement("fa3") and "hopper" in missing_requirement("fa3")
    assert "flex_attention" in missing_requirement("flex")
    assert missing_requirement("flash") is None and missing_requirement("triton") is None
    with pytest.raises(ValueError, match="unknown attention backend"):
        missing_requirement("fa2")
    monkeypatch.setattr(ab, "_spec_exists", lambda name: name == "flash_attn_interface")  # an older FA3 build
    assert missing_requirement("fa3") is None and missing_requirement("fa4") is not None


def test_gpt_config_checks_the_package(monkeypatch):
    monkeypatch.setattr(ab, "_spec_exists", lambda name: False)
    with pytest.raises(ValueError, match="attention='fa4' needs FlashAttention 4 .*pip install flash-attn-4"):
        GPTConfig.from_name("tiny", attention="fa4")
    with pytest.raises(ValueError, match="attention='fa3' needs FlashAttention 3"):
        GPTConfig.from_name("tiny", attention="fa3")
    with pytest.raises(ValueError, match="attention='xformers' is not one of"):
        GPTConfig.from_name("tiny", attention="xformers")
    assert GPTConfig.from_name("tiny", attention="auto").attention == "auto"  # auto needs none of them
    monkeypatch.setattr(ab, "_spec_exists", lambda name: True)
    assert GPTConfig.from_name("tiny", attention="fa4").attention == "fa4"


def test_config_and_dispatcher_agree_on_the_names():
    from lightning_perf.kernels.dispatch import ATTENTION_IMPLS
    from lightning_perf.models.gpt import config

    assert set(config._ATTENTION) == set(ATTENTION_IMPLS)


def test_gpt_with_flex_on_cpu_runs_sdpa(close):
    """attention='flex' on CPU falls back to SDPA (no FlexAttention backward there): same loss."""
    from lightning_perf.models.gpt import GPT

    cfg = GPTConfig.from_name("tiny-llama", n_layer=1)
    torch.manual_seed(0)
    ref = GPT(cfg)
    flex = GPT(cfg.replace(attention="flex"))
    flex.load_state_dict(ref.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    close(flex(idx, idx), ref(idx, idx), 0, 0, "loss")
