"""Kernel benchmark: lightning_perf's Triton kernels against torch eager, torch.compile and SDPA.

One GPU, one call, a few minutes:

    python benchmarks/bench_kernels.py --out benchmarks/results

Measures the device first (device-to-device copy bandwidth, bf16 8192^3 matmul), checks
every kernel against its PyTorch reference in bf16 on the GPU (relative error of outputs
and gradients), then times each kernel and its baselines with CUDA events after warm-up
(median of many runs, with the 10th-90th percentile spread). The timed runs are queued behind
a spin kernel that holds the GPU, so the window holds device time only: a memory-bound kernel
of ~0.1 ms is otherwise timed at the speed of its Python launch path. The run-by-run time
(``ms_unqueued``) and the host launch time (``host_ms``) are recorded beside it. Autotuning
starts from a fresh cache unless ``--tune-cache`` names one.

- norms, activations, rotary (memory-bound): GB/s and % of the measured copy bandwidth,
  speed-up over torch.compile of the same reference;
- fused linear cross-entropy: time and peak extra memory against eager and compiled
  ``cross_entropy(linear(x, W).float(), t)``;
- flash attention (causal, forward and forward+backward): TFLOP/s and % of the matmul
  ceiling against every SDPA backend (cuDNN, flash, efficient) and ``attention="auto"``;
- FP8 casts (``--only fp8``, memory-bound; the FP8 linears of the gpt-1.3b step, 16384 tokens):
  the scale-cast-transpose (q and q^T in one pass; tensorwise) and its delayed-scaling form that
  also reduces the amax, per activation / gradient shape and both FP8 formats, checked byte for
  byte against the PyTorch reference; the amax pass before a tensorwise cast; and the fused GELU +
  cast-transpose of the delayed GELU MLP (forward: gelu(u + b) -> q, q^T, amax; backward:
  dL/dh * gelu'(u + b) -> q, q^T, amax, bias gradient) against ``unfused``, what the two delayed
  layers run instead (Inductor's GELU writing bf16, then the cast-transpose), checked within one
  FP8 step of the float64 operand's cast (all but 0.1% of the elements) and q^T byte for byte.

Writes ``bench_kernels_<date>.json`` and ``bench_kernels_<date>.png`` under ``--out``
(default ``$OUT`` or ``benchmarks/results``) and prints a table. A failing variant is
recorded with its error and the run goes on; ``--budget-s`` stops starting new variants
after that many seconds. ``--quick`` times the headline shapes only (about 4 minutes);
``--smoke`` runs the same code at tiny sizes on the CPU (Triton interpreter).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

if __name__ == "__main__" and "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (the script, not the library)

import torch.nn.functional as F  # noqa: E402

from lightning_perf.kernels import dispatch  # noqa: E402
from lightning_perf.kernels.autotune import configure, default_tuner, hold_gpu  # noqa: E402
from lightning_perf.kernels.ops import fp8_casts as f8  # noqa: E402
from lightning_perf.kernels.ops import fp8_gelu_mlp as f8_mlp  # noqa: E402
from lightning_perf.kernels.ops import fp8_gelu_operand as f8_gelu  # noqa: E402
from lightning_perf.kernels.ops.flash_attention import attention_reference, flash_attention  # noqa: E402
from lightning_perf.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from lightning_perf.kernels.ops.gelu import gelu_tanh  # noqa: E402
from lightning_perf.kernels.ops.layer_norm import layer_norm  # noqa: E402
from lightning_perf.kernels.ops.rms_norm import rms_norm  # noqa: E402
from lightning_perf.kernels.ops.rotary import rotary_embedding, rotary_embedding_reference  # noqa: E402
from lightning_perf.kernels.ops.swiglu import swiglu  # noqa: E402
from lightning_perf.models.gpt.model import rope_cache  # noqa: E402

# ---- timing ------------------------------------------------------------------------------------


class Bench:
    def __init__(self, device: torch.device, warmup: int, reps: int, deadline: float) -> None:
        self.device, self.warmup, self.reps, self.deadline = device, warmup, reps, deadline
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], reps: Optional[int] = None) -> dict:
        """Median / p10 / p90 milliseconds of ``fn`` over ``reps`` runs after warm-up.

        On CUDA three numbers per variant:
        - ``ms``: device time. A spin kernel holds the GPU while all ``reps`` runs are queued, so
          the events see the kernels back to back and none of the host's launch time. This is
          the number the speed-ups use: it is what the kernels cost inside a training step whose
          host runs ahead of the GPU (large matmuls queued, CUDA graphs, torch.compile).
        - ``ms_unqueued``: the same runs timed one after the other with the GPU free: for a step
          shorter than its Python launch path this is host time, with its jitter.
        - ``host_ms``: median CPU time to launch one run (nothing waited for).
        """
        reps = reps or self.reps
        host = []
        for _ in range(self.warmup):
            self.sync()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
        self.sync()
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return {**_stats(times), "reps": reps}
        host_ms = statistics.median(host[1:] or host)  # the first warm-up run may compile / autotune
        res = {**_stats(self._events(fn, reps, hold_ms=3.0 * reps * host_ms + 1.0)), "reps": reps,
               "host_ms": host_ms}
        unq = _stats(self._events(fn, reps, hold_ms=0.0))
        res["ms_unqueued"], res["p90_ms_unqueued"] = unq["ms"], unq["p90_ms"]
        return res

    def _events(self, fn: Callable[[], Any], reps: int, hold_ms: float) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        self.sync()
        if hold_ms > 0:
            hold_gpu(hold_ms * 1e-3)  # capped at 50 ms: beyond that the first runs may include host time
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    def out_of_time(self) -> bool:
        return time.time() > self.deadline


def _stats(times: list[float]) -> dict:
    times = sorted(times)
    q = lambda p: times[min(len(times) - 1, int(p * (len(times) - 1) + 0.5))]  # noqa: E731
    return {"ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9)}


def peak_extra_mb(fn: Callable[[], Any], cuda: bool) -> Optional[float]:
    """Peak memory allocated above the starting point while ``fn`` runs (MB)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: Optional[torch.Tensor] = None):
    def run():
        out = fn(*inputs)
        g = grad if grad is not None else torch.ones_like(out)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g)

    return run


def first(out):
    return out[0] if isinstance(out, tuple) else out


# ---- device ceilings ---------------------------------------------------------------------------


def measure_ceilings(b: Bench, smoke: bool) -> dict:
    n = (1 << 28) if not smoke else (1 << 16)  # 512 MiB of bf16 each way
    src = torch.randn(n, device=b.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = b.time(lambda: dst.copy_(src), reps=20)
    copy_gbs = 2 * n * 2 / (t["ms"] * 1e-3) / 1e9
    m = 8192 if not smoke else 256
    dtype = torch.bfloat16 if b.cuda else torch.float32
    x, y = torch.randn(m, m, device=b.device, dtype=dtype), torch.randn(m, m, device=b.device, dtype=dtype)
    t = b.time(lambda: x @ y, reps=20)
    mm_tflops = 2 * m**3 / (t["ms"] * 1e-3) / 1e12
    del src, dst, x, y
    return {"copy_GBps": copy_gbs, "matmul_TFLOPs": mm_tflops, "matmul_size": m, "copy_bytes_each_way": n * 2}


# ---- cases -------------------------------------------------------------------------------------


class Case:
    """One kernel at one size: variants (name -> fn running one timed step), bytes or FLOPs per step."""

    def __init__(self, group: str, name: str, mode: str, variants: dict[str, Callable], *, bytes_moved: float = 0,
                 flops: float = 0, baseline: str = "compile", check: Optional[Callable[[], dict]] = None,
                 memory: bool = False, grad_bytes: int = 0, tolerance: Optional[dict[str, float]] = None) -> None:
        self.group, self.name, self.mode, self.variants = group, name, mode, variants
        self.bytes_moved, self.flops, self.baseline, self.check, self.memory = bytes_moved, flops, baseline, check, memory
        self.grad_bytes = grad_bytes  # size of the gradients every variant must return
        # the check's error bound per figure (default 3e-2, relative errors in bf16); 0: must be exact
        self.tolerance = tolerance or {}

    def within(self, errors: dict[str, float]) -> bool:
        def ok(key: str, err: float) -> bool:
            tol = self.tolerance.get(key, 3e-2)
            return err == 0 if tol == 0 else err < tol

        return all(ok(k, e) for k, e in errors.items())


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def _rnd(*shape, device, dtype, grad=True, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(grad)


def norm_cases(device, dtype, tokens, widths):
    out = []
    rms_ref = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)  # noqa: E731
    ln_ref = lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)  # noqa: E731
    rms_c, ln_c = compiled(rms_ref), compiled(ln_ref)
    for d in widths:
        x = _rnd(tokens, d, device=device, dtype=dtype)
        w = _rnd(d, device=device, dtype=dtype, scale=0.1)
        bias = _rnd(d, device=device, dtype=dtype, scale=0.1)
        with torch.no_grad():
            w.add_(1.0)
        dy = torch.randn_like(x)
        elem = x.element_size() * tokens * d
        for kind, ours, ref, comp, ins in (
            ("rms_norm", lambda x, w: rms_norm(x, w, 1e-6), rms_ref, rms_c, [x, w]),
            ("layer_norm", lambda x, w, b: layer_norm(x, w, b, 1e-5), ln_ref, ln_c, [x, w, bias]),
        ):
            def check(ours=ours, ref=ref, ins=ins, dy=dy):
                return _check_fwd_bwd(ours, ref, ins, dy)

            out.append(Case("norm", f"{kind} {tokens}x{d}", "fwd", {
                "triton": lambda o=ours, i=ins: o(*i), "eager": lambda r=ref, i=ins: r(*i),
                "compile": lambda c=comp, i=ins: c(*i)}, bytes_moved=2 * elem, check=check))
            out.append(Case("norm", f"{kind} {tokens}x{d}", "fwd+bwd", {
                "triton": fwd_bwd(ours, ins, dy), "eager": fwd_bwd(ref, ins, dy), "compile": fwd_bwd(comp, ins, dy)},
                bytes_moved=5 * elem))
    # fused residual add: y, h = norm(x + r) against the two ops
    d = widths[-1]
    x, r = _rnd(tokens, d, device=device, dtype=dtype), _rnd(tokens, d, device=device, dtype=dtype)
    w = _rnd(d, device=device, dtype=dtype)
    ref = lambda x, r, w: (lambda h: (F.rms_norm(h, (d,), w, 1e-6), h))(x + r)  # noqa: E731
    comp = compiled(ref)
    elem = x.element_size() * tokens * d
    out.append(Case("norm", f"rms_norm+residual {tokens}x{d}", "fwd", {
        "triton": lambda: rms_norm(x, w, 1e-6, r), "eager": lambda: ref(x, r, w), "compile": lambda: comp(x, r, w)},
        bytes_moved=4 * elem))
    return out


def _check_fwd_bwd(ours, ref, inputs, dy) -> dict:
    """Relative errors of output and input grads, ours vs an fp32 run of the reference."""
    o = first(ours(*inputs))
    g_ours = torch.autograd.grad(o, inputs, dy)
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    r = first(ref(*ref_in))
    g_ref = torch.autograd.grad(r, ref_in, dy.float())
    errs = {"out": rel_err(o, r)}
    errs.update({f"grad{i}": rel_err(a, b) for i, (a, b) in enumerate(zip(g_ours, g_ref))})
    return errs


def activation_cases(device, dtype, tokens, widths):
    out = []
    swi_ref = lambda g, u: F.silu(g) * u  # noqa: E731
    gelu_ref = lambda a: F.gelu(a, approximate="tanh")  # noqa: E731
    swi_c, gelu_c = compiled(swi_ref), compiled(gelu_ref)
    for f in widths:
        g, u = _rnd(tokens, f, device=device, dtype=dtype), _rnd(tokens, f, device=device, dtype=dtype)
        dy = torch.randn_like(g)
        elem = g.element_size() * tokens * f
        out.append(Case("activation", f"swiglu {tokens}x{f}", "fwd", {
            "triton": lambda g=g, u=u: swiglu(g, u), "eager": lambda g=g, u=u: swi_ref(g, u),
            "compile": lambda g=g, u=u: swi_c(g, u)}, bytes_moved=3 * elem,
            check=lambda g=g, u=u, dy=dy: _check_fwd_bwd(swiglu, swi_ref, [g, u], dy)))
        out.append(Case("activation", f"swiglu {tokens}x{f}", "fwd+bwd", {
            "triton": fwd_bwd(swiglu, [g, u], dy), "eager": fwd_bwd(swi_ref, [g, u], dy),
            "compile": fwd_bwd(swi_c, [g, u], dy)}, bytes_moved=8 * elem))
        out.append(Case("activation", f"gelu_tanh {tokens}x{f}", "fwd", {
            "triton": lambda g=g: gelu_tanh(g), "eager": lambda g=g: gelu_ref(g), "compile": lambda g=g: gelu_c(g)},
            bytes_moved=2 * elem, check=lambda g=g, dy=dy: _check_fwd_bwd(gelu_tanh, gelu_ref, [g], dy)))
        out.append(Case("activation", f"gelu_tanh {tokens}x{f}", "fwd+bwd", {
            "triton": fwd_bwd(gelu_tanh, [g], dy), "eager": fwd_bwd(gelu_ref, [g], dy),
            "compile": fwd_bwd(gelu_c, [g], dy)}, bytes_moved=5 * elem))
    return out


def rotary_cases(device, dtype, B, H, T, D):
    cos, sin = rope_cache(T, D, 500000.0, device)
    x = torch.randn(B, T, H, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_()  # projection layout
    dy = torch.randn(B, H, T, D, device=device, dtype=dtype)

    def ref(t):  # the model's apply_rope
        c, s = cos[:T].to(t.dtype), sin[:T].to(t.dtype)
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((t1 * c - t2 * s, t2 * c + t1 * s), dim=-1)

    comp = compiled(ref)
    ours = lambda t: rotary_embedding(t, cos, sin)  # noqa: E731
    elem = x.numel() * x.element_size()
    name = f"rotary B{B} H{H} T{T} hd{D}"
    return [
        Case("rotary", name, "fwd", {"triton": lambda: ours(x), "eager": lambda: ref(x), "compile": lambda: comp(x)},
             bytes_moved=2 * elem, check=lambda: _check_fwd_bwd(ours, lambda t: rotary_embedding_reference(t, cos, sin),
                                                                [x], dy)),
        Case("rotary", name, "fwd+bwd", {"triton": fwd_bwd(ours, [x], dy), "eager": fwd_bwd(ref, [x], dy),
                                         "compile": fwd_bwd(comp, [x], dy)}, bytes_moved=4 * elem),
    ]


def flce_cases(device, dtype, tokens, shapes):
    out = []
    ref = lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)  # noqa: E731 (the GPT's torch path)
    comp = compiled(ref)
    for d, V in shapes:
        x = _rnd(tokens, d, device=device, dtype=dtype)
        w = _rnd(V, d, device=device, dtype=dtype, scale=d**-0.5)
        t = torch.randint(0, V, (tokens,), device=device)
        ins = [x, w, t]

        def check(x=x, w=w, t=t):
            loss = fused_linear_cross_entropy(x, w, t)
            g = torch.autograd.grad(loss, (x, w))
            xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
            r = ref(xf, wf, t)
            gr = torch.autograd.grad(r, (xf, wf))
            return {"loss": rel_err(loss, r), "dx": rel_err(g[0], gr[0]), "dW": rel_err(g[1], gr[1])}

        def step(fn, ins=ins):
            def run():
                loss = fn(*ins)
                torch.autograd.grad(loss, ins[:2])
            return run

        out.append(Case("fused_linear_cross_entropy", f"FLCE N{tokens} d{d} V{V}", "fwd+bwd", {
            "triton": step(fused_linear_cross_entropy), "eager": step(ref), "compile": step(comp)},
            flops=6 * tokens * d * V, check=check, memory=True, grad_bytes=(x.numel() + w.numel()) * x.element_size()))
    return out


def attention_cases(device, dtype, shapes):
    out = []
    auto = dispatch.KernelDispatcher()
    for B, H, HK, T, D in shapes:
        q = torch.randn(B, T, H, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(B, T, HK, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        v = torch.randn(B, T, HK, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        do = torch.randn(B, H, T, D, device=device, dtype=dtype)
        variants = {"triton": lambda q, k, v: flash_attention(q, k, v, causal=True)}
        for backend in dispatch.SDPA_BACKENDS:
            variants[f"sdpa_{backend}"] = lambda q, k, v, b=backend: dispatch.sdpa(q, k, v, True, b)

        def auto_fn(q, k, v):
            o = auto.attention(q, k, v, causal=True, impl="auto")
            return o if o is not None else dispatch.sdpa(q, k, v, True)

        variants["auto"] = auto_fn
        fwd_flops = 2 * 2 * B * H * T * T * D / 2  # causal: half the square
        name = f"attn B{B} H{H}/{HK} T{T} hd{D}"

        def check(q=q, k=k, v=v, do=do):
            errs = _check_fwd_bwd(lambda *a: flash_attention(*a, causal=True),
                                  lambda *a: attention_reference(*a, causal=True), [q, k, v], do)
            return errs

        ins = [q, k, v]
        out.append(Case("attention", name, "fwd", {n: (lambda f=f, i=ins: f(*i)) for n, f in variants.items()},
                        flops=fwd_flops, baseline="sdpa_cudnn", check=check if T * T * B * H <= 2**31 else None))
        out.append(Case("attention", name, "fwd+bwd", {n: fwd_bwd(f, ins, do) for n, f in variants.items()},
                        flops=3.5 * fwd_flops, baseline="sdpa_cudnn"))
        out[-1].auto = auto  # noqa: the selector's choice goes into the JSON
    return out


def _bytes_differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of bytes in which two FP8 tensors differ."""
    return float((got.view(torch.uint8) != want.view(torch.uint8)).float().mean())


def _over_one_fp8_step(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The share of elements of two FP8 tensors more than one step of the format apart (below the normal
    range the step is the subnormal spacing)."""
    mantissa, min_exponent = (3, -6) if dtype == f8.E4M3 else (2, -14)
    g, w = got.float(), want.float()
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=1e-30))).clamp(min=min_exponent) - mantissa)
    return float(((g - w).abs() > step * 1.001).float().mean())


def fp8_cases(device, tokens, widths, gelu_width):
    """The FP8 casts of the delayed and tensorwise linears (module docstring), the package's ops as the
    layers call them."""
    out = []
    ct_ref, cta_ref = compiled(f8.cast_transpose_fp8_reference), compiled(f8.cast_transpose_amax_fp8_reference)
    amax_ref = lambda t: t.abs().amax().float()  # noqa: E731
    amax_c = compiled(amax_ref)
    for n, src in widths:  # the LayerNorm outputs reach the casts in fp32 under autocast, the rest in bf16
        torch.manual_seed(0)
        t = (torch.randn(tokens, n, device=device) * 3).to(src)
        size = f"{str(src).removeprefix('torch.')} {tokens}x{n}"
        out.append(Case("fp8", f"amax {size}", "fwd", {
            "triton": lambda t=t: f8.absmax(t), "eager": lambda t=t: amax_ref(t), "compile": lambda t=t: amax_c(t)},
            bytes_moved=t.numel() * t.element_size(), tolerance={"amax_differs": 0},
            check=lambda t=t: {"amax_differs": float(f8.absmax(t) != amax_ref(t))}))
        for dtype in (f8.E4M3, f8.E5M2):
            scale = f8._scale_of(t, dtype)
            moved = t.numel() * (t.element_size() + 2)  # read once, q and q^T written once
            fmt = str(dtype).removeprefix("torch.float8_")

            def check_ct(t=t, scale=scale, dtype=dtype):
                (q, qt), (wq, wqt) = f8.cast_transpose_fp8(t, scale, dtype), f8.cast_transpose_fp8_reference(
                    t, scale, dtype)
                return {"q_bytes_differ": _bytes_differ(q, wq), "qt_bytes_differ": _bytes_differ(qt, wqt)}

            def check_cta(t=t, scale=scale, dtype=dtype):
                (q, qt, a), (wq, wqt, wa) = f8.cast_transpose_amax_fp8(t, scale, dtype), \
                    f8.cast_transpose_amax_fp8_reference(t, scale, dtype)
                return {"q_bytes_differ": _bytes_differ(q, wq), "qt_bytes_differ": _bytes_differ(qt, wqt),
                        "amax_differs": float(a != wa)}

            exact = {"q_bytes_differ": 0, "qt_bytes_differ": 0, "amax_differs": 0}
            out.append(Case("fp8", f"cast_transpose {size} -> {fmt}", "fwd", {
                "triton": lambda t=t, s=scale, d=dtype: f8.cast_transpose_fp8(t, s, d),
                "eager": lambda t=t, s=scale, d=dtype: f8.cast_transpose_fp8_reference(t, s, d),
                "compile": lambda t=t, s=scale, d=dtype: ct_ref(t, s, d)},
                bytes_moved=moved, check=check_ct, tolerance=exact))
            out.append(Case("fp8", f"cast_transpose_amax {size} -> {fmt}", "fwd", {
                "triton": lambda t=t, s=scale, d=dtype: f8.cast_transpose_amax_fp8(t, s, d),
                "eager": lambda t=t, s=scale, d=dtype: f8.cast_transpose_amax_fp8_reference(t, s, d),
                "compile": lambda t=t, s=scale, d=dtype: cta_ref(t, s, d)},
                bytes_moved=moved, check=check_cta, tolerance=exact))
    # the delayed GELU MLP's hidden activation: u (tokens, F) in bf16, its bias, the gradient dL/dh
    torch.manual_seed(0)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    u = (torch.randn(tokens, gelu_width, device=device) * 1.5).to(half)
    b = torch.randn(gelu_width, device=device) * 0.1
    dh = (torch.randn(tokens, gelu_width, device=device) * 1e-3).to(half)
    gelu_c = compiled(lambda u, b: F.gelu(u + b.to(u.dtype), approximate="tanh"))
    gelu_bwd_c = compiled(lambda dh, u, b: torch.ops.aten.gelu_backward(dh, u + b.to(u.dtype), approximate="tanh"))
    ref_c = compiled(f8_mlp.gelu_cast_transpose_fp8_reference)
    for grad in (False, True):
        dtype = f8.E5M2 if grad else f8.E4M3
        d = dh if grad else None
        h = f8_gelu.gelu_operand_reference(u, b, d)  # float64 maths, fp32
        scale = f8._scale_of(h, dtype)
        if grad:
            def unfused(scale=scale, dtype=dtype):  # the bias gradient: Inductor fuses it into the GELU backward
                g = gelu_bwd_c(dh, u, b)
                return f8.cast_transpose_amax_fp8(g, scale, dtype), g.float().sum(0)
        else:
            def unfused(scale=scale, dtype=dtype):
                return f8.cast_transpose_amax_fp8(gelu_c(u, b), scale, dtype)

        def check(h=h, scale=scale, dtype=dtype, d=d):
            q, qt, amax, db = f8_mlp.gelu_cast_transpose_fp8(u, b, scale, dtype, d)
            want, _ = f8.cast_transpose_fp8_reference(h, scale, dtype)
            errs = {"q_over_one_fp8_step": _over_one_fp8_step(q, want, dtype),
                    "qt_bytes_differ_from_q_transposed": _bytes_differ(qt, q.t().contiguous()),
                    "amax_rel": rel_err(amax, h.abs().amax())}
            if d is not None:
                errs["bias_grad_rel"] = rel_err(db, h.double().sum(0))
            return errs

        moved = u.numel() * (u.element_size() * (2 if grad else 1) + 2)  # u (and dh) read, q and q^T written
        out.append(Case("fp8", f"gelu_cast_transpose {tokens}x{gelu_width} -> {str(dtype).removeprefix('torch.float8_')}",
                        "bwd" if grad else "fwd", {
                            "triton": lambda s=scale, f=dtype, d=d: f8_mlp.gelu_cast_transpose_fp8(u, b, s, f, d),
                            "unfused": unfused,
                            "compile": lambda s=scale, f=dtype, d=d: ref_c(u, b, s, f, d)},
                        bytes_moved=moved, baseline="unfused", check=check,
                        # fp32 maths against float64: where gelu'(a) crosses zero an operand may change sign
                        tolerance={"q_over_one_fp8_step": 1e-3, "qt_bytes_differ_from_q_transposed": 0,
                                   "amax_rel": 1e-5, "bias_grad_rel": 1e-4}))
    return out


# ---- driver ------------------------------------------------------------------------------------


def run_case(b: Bench, case: Case, ceilings: dict) -> dict:
    row: dict[str, Any] = {"group": case.group, "name": case.name, "mode": case.mode, "baseline": case.baseline,
                           "bytes": case.bytes_moved, "flops": case.flops, "variants": {}}
    if case.check is not None:
        try:
            with torch.no_grad() if False else torch.enable_grad():
                row["rel_err"] = case.check()
            row["correct"] = case.within(row["rel_err"])
        except Exception as err:
            row["check_error"] = f"{type(err).__name__}: {err}"
            row["correct"] = False
    for name, fn in case.variants.items():
        if b.out_of_time():
            row["variants"][name] = {"error": "skipped: time budget"}
            continue
        try:
            res = b.time(fn)
            if case.bytes_moved:
                res["GBps"] = case.bytes_moved / (res["ms"] * 1e-3) / 1e9
                res["pct_copy_bw"] = 100 * res["GBps"] / ceilings["copy_GBps"]
            if case.flops:
                res["TFLOPs"] = case.flops / (res["ms"] * 1e-3) / 1e12
                res["pct_matmul"] = 100 * res["TFLOPs"] / ceilings["matmul_TFLOPs"]
            if case.memory:
                res["peak_extra_MB"] = peak_extra_mb(fn, b.cuda)
                if res["peak_extra_MB"] is not None:
                    res["peak_extra_beyond_grads_MB"] = res["peak_extra_MB"] - case.grad_bytes / 2**20
            row["variants"][name] = res
        except Exception as err:
            row["variants"][name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            if b.cuda:
                torch.cuda.empty_cache()
    mem = {n: v["peak_extra_MB"] for n, v in row["variants"].items() if v.get("peak_extra_MB")}
    if "triton" in mem and case.baseline in mem:
        row["memory_ratio_vs_baseline"] = mem["triton"] / mem[case.baseline]
    ours = row["variants"].get("triton", {}).get("ms")
    base = row["variants"].get(case.baseline, {}).get("ms")
    if ours and base:
        row["speedup_vs_baseline"] = base / ours
    ours_u = row["variants"].get("triton", {}).get("ms_unqueued")
    base_u = row["variants"].get(case.baseline, {}).get("ms_unqueued")
    if ours_u and base_u:  # includes each side's launch path when the kernels are shorter than it
        row["speedup_vs_baseline_unqueued"] = base_u / ours_u
    sdpa = [v["ms"] for n, v in row["variants"].items() if n.startswith("sdpa") and "ms" in v]
    if ours and sdpa:
        row["speedup_vs_best_sdpa"] = min(sdpa) / ours
    if hasattr(case, "auto"):
        row["auto_choices"] = {str(k): c for k, c in case.auto.attention_selector.choices.items()}
    return row


def build_cases(device, smoke: bool, quick: bool = False) -> list:
    dt_ = torch.bfloat16 if device.type == "cuda" else torch.float32
    if smoke:
        tokens, widths, acts = 64, [32, 48], [64]
        rot = (1, 2, 16, 32)
        flce = [(32, 100)]
        attn = [(1, 2, 2, 32, 16), (1, 4, 2, 48, 32)]
        fp8 = [(32, torch.float32), (48, dt_)]
        gelu_width = 64
    else:
        tokens, widths, acts = 16384, [768, 2048, 4096], [3072, 8192, 14336]
        rot = (4, 32, 4096, 128)  # Llama-8B q at 16k tokens
        flce = [(768, 50304), (2048, 128256), (4096, 128256)]
        attn = [(16, 12, 12, 1024, 64), (4, 16, 16, 4096, 128), (2, 16, 16, 8192, 128), (4, 32, 8, 2048, 128),
                (8, 16, 16, 1024, 128)]
        # gpt-1.3b's FP8 operands: LayerNorm outputs (fp32), q/k/v and MLP widths, the MLP's hidden activation
        fp8 = [(2048, torch.float32), (2048, torch.bfloat16), (6144, torch.bfloat16), (8192, torch.bfloat16)]
        gelu_width = 8192
    if quick and not smoke:  # the headline shapes only
        widths, acts = [4096], [8192]
        flce = [(768, 50304), (4096, 128256)]
        attn = [(16, 12, 12, 1024, 64), (4, 16, 16, 4096, 128)]
        fp8 = [(2048, torch.float32), (8192, torch.bfloat16)]
    builders = [
        ("attention", lambda: attention_cases(device, dt_, attn)),
        ("fused_linear_cross_entropy", lambda: flce_cases(device, dt_, tokens, flce)),
        ("norm", lambda: norm_cases(device, dt_, tokens, widths)),
        ("activation", lambda: activation_cases(device, dt_, tokens, acts)),
        ("rotary", lambda: rotary_cases(device, dt_, *rot)),
        ("fp8", lambda: fp8_cases(device, tokens, fp8, gelu_width)),
    ]
    return builders


def plot(rows: list[dict], path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no matplotlib: {err}"
    items = [(f"{r['name']} [{r['mode']}] vs {r['baseline']}", r["speedup_vs_baseline"]) for r in rows
             if "speedup_vs_baseline" in r]
    if not items:
        return "nothing to plot"
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(items) + 1.8))
    labels, values = zip(*items)
    colors = ["tab:green" if v >= 1.0 else "tab:red" for v in values]
    ax.barh(range(len(values)), values, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of the Triton kernel (baseline time / kernel time)")
    ax.set_title("lightning_perf Triton kernels: speed-up over torch.compile\n(norms, activations, rotary, "
                 "fused loss, FP8 casts), over SDPA cuDNN (attention), over the unfused pair (GELU cast)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def print_table(rows: list[dict], ceilings: dict) -> None:
    print(f"\ncopy {ceilings['copy_GBps']:.0f} GB/s, matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s")
    print("ms: device time (launches queued behind a held GPU); unq: run by run with the GPU free; "
          "host: CPU launch time")
    head = (f"{'kernel':44s} {'mode':8s} {'variant':15s} {'ms':>9s} {'GB/s|TF':>8s} {'%ceil':>6s} {'memMB':>7s} "
            f"{'unq ms':>8s} {'host ms':>8s}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        for name, v in r["variants"].items():
            if "error" in v:
                print(f"{r['name'][:44]:44s} {r['mode']:8s} {name:15s} ERROR {v['error'][:60]}")
                continue
            rate = v.get("GBps", v.get("TFLOPs", 0.0))
            pct = v.get("pct_copy_bw", v.get("pct_matmul", 0.0))
            mem = v.get("peak_extra_MB")
            print(f"{r['name'][:44]:44s} {r['mode']:8s} {name:15s} {v['ms']:9.3f} {rate:8.1f} {pct:6.1f} "
                  f"{(f'{mem:7.0f}' if mem is not None else '      -')} {v.get('ms_unqueued', float('nan')):8.3f} "
                  f"{v.get('host_ms', float('nan')):8.3f}")
        extra = []
        if "speedup_vs_baseline" in r:
            extra.append(f"x{r['speedup_vs_baseline']:.2f} vs {r['baseline']}")
        if "speedup_vs_baseline_unqueued" in r:
            extra.append(f"unqueued x{r['speedup_vs_baseline_unqueued']:.2f}")
        if "memory_ratio_vs_baseline" in r:
            extra.append(f"memory {r['memory_ratio_vs_baseline']:.2f}x of {r['baseline']}")
        if "rel_err" in r:
            extra.append("check " + ("ok" if r.get("correct") else "FAILED") + " " +
                         ", ".join(f"{k}={e:.1e}" for k, e in r["rel_err"].items()))
        if "check_error" in r:
            extra.append("check error: " + r["check_error"][:80])
        if extra:
            print(f"{'':44s} -> " + "; ".join(extra))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU ok (Triton interpreter)")
    p.add_argument("--only", nargs="*", default=None,
                   help="groups to run: attention fused_linear_cross_entropy norm activation rotary fp8")
    p.add_argument("--quick", action="store_true", help="headline shapes only (about 4 minutes on an H200)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop timing new variants after this long (default 400, --quick 280)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--tune-cache", default=None,
                   help="autotune cache directory to read and extend (default: a fresh one, so every run re-tunes "
                        "the current kernels instead of reusing choices made for older code or timings)")
    args = p.parse_args(argv)

    t_start = time.time()
    tune_cache = args.tune_cache or tempfile.mkdtemp(prefix="bench_kernels_tune_")
    configure(cache_dir=tune_cache)
    if args.budget_s is None:
        args.budget_s = 280.0 if args.quick else 400.0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
        return 2
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    reps = args.reps or (3 if args.smoke else 15 if args.quick else 30)
    b = Bench(device, warmup=1 if args.smoke else 3, reps=reps, deadline=t_start + args.budget_s)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    import triton

    result: dict[str, Any] = {
        "benchmark": "bench_kernels",
        "date_utc": stamp,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "smoke": args.smoke,
        "config": {"reps": reps, "warmup": b.warmup, "budget_s": args.budget_s, "only": args.only, "quick": args.quick,
                   "dtype": "bf16" if device.type == "cuda" else "fp32", "tune_cache": tune_cache,
                   "timing": "ms = device time with the launches queued behind a held GPU; ms_unqueued = run by "
                             "run with the GPU idle in between (includes host launch time when it is longer)"},
        "rows": [],
        "errors": [],
    }
    result["ceilings"] = measure_ceilings(b, args.smoke)
    print(f"device {result['device']}: copy {result['ceilings']['copy_GBps']:.0f} GB/s, "
          f"matmul {result['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    for group, build in build_cases(device, args.smoke, args.quick):
        if args.only and group not in args.only:
            continue
        if b.out_of_time():
            result["errors"].append(f"{group}: skipped, time budget of {args.budget_s:.0f}s spent")
            continue
        try:
            cases = build()
        except Exception as err:
            result["errors"].append(f"{group}: setup failed: {type(err).__name__}: {err}")
            traceback.print_exc()
            continue
        for case in cases:
            t0 = time.time()
            row = run_case(b, case, result["ceilings"])
            row["wall_s"] = time.time() - t0
            result["rows"].append(row)
            sp = row.get("speedup_vs_baseline")
            print(f"[{time.time() - t_start:6.1f}s] {case.name} {case.mode}: "
                  + ", ".join(f"{n}={v['ms']:.3f}ms" if "ms" in v else f"{n}=ERR" for n, v in row["variants"].items())
                  + (f"  (x{sp:.2f} vs {case.baseline})" if sp else ""), flush=True)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["autotuned"] = {"|".join(map(str, k)): v for k, v in default_tuner()._memory.items()}
    result["wall_s"] = time.time() - t_start
    json_path = out_dir / f"bench_kernels_{stamp}{'_smoke' if args.smoke else ''}.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    png_err = plot(result["rows"], out_dir / json_path.name.replace(".json", ".png"))
    if png_err:
        print(f"plot: {png_err}")
    print_table(result["rows"], result["ceilings"])
    print(f"\nwrote {json_path} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
