"""The fused GELU + FP8 cast-transpose kernels of the delayed-FP8 MLP, alone (GPU only).

    python benchmarks/bench_gelu_cast.py --out DIR

At the gpt-1.3b MLP's hidden activation (tokens 16384 x F 8192, u in bf16): forward (h = gelu(u + b)
-> q(h), q(h)^T, amax) and backward (dL/du = dL/dh * gelu'(u + b) -> q, q^T, amax, bias gradient),
each as the library runs it (``gelu_cast_transpose_fp8``), in forms defined here, and unfused as the
layers run it (Inductor's GELU kernel writing bf16, then the library cast-transpose), beside a
plain copy of the bytes each must move. The forms:

- ``library``: the kernel as the library has it (GELU once per element, the transposed copy read back
  from the FP8 tile it stored, after a barrier);
- ``recompute``: the transposed copy from transposed loads of the inputs, GELU evaluated again for
  them (as ``_cast_transpose_kernel`` reloads its input);
- ``tl_trans``: GELU once per element, the FP8 tile transposed on chip as bytes (``tl.trans``);
- ``tl_trans_fast``: as ``tl_trans``, with tanh from the hardware's approximate instruction.

``unfused`` is what the delayed layers run (Inductor's GELU or GELU backward writing bf16, then the
library cast-transpose; backwards also the bias gradient's column sums, here as a separate fp32
reduction, which Inductor fuses into the GELU backward inside a compiled model). Every form is checked
against the library op (the share of q's elements that differ and by how many FP8 steps;
whether q^T is q transposed, ``transposed_ok``: the ``tl_trans`` forms have failed that with Triton 3.6). JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_perf.kernels.ops import fp8_casts as f8  # noqa: E402
from lightning_perf.kernels.ops import fp8_gelu_mlp as f8_mlp  # noqa: E402
from lightning_perf.kernels.ops import fp8_gelu_operand as f8_gelu  # noqa: E402


@triton.jit
def _tanh_fast(z):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [z], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _operand(U, BIAS, DH, rows, cols, mask, stride, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr,
             FAST: tl.constexpr):
    a = tl.load(U + rows.to(tl.int64) * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    if FAST:
        z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        t = _tanh_fast(z)
        h = 0.5 * a * (1.0 + t)
        d = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)
    else:
        h, d = f8_gelu._gelu_parts(a)
    if GRAD:
        h = d * tl.load(DH + rows.to(tl.int64) * stride + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, h, 0.0)


@triton.jit
def _recompute_kernel(U, BIAS, DH, Q, QT, SCALE, AMAX, DBP, M, N, stride, FMAX: tl.constexpr,
                      ROUND_TO_2_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    h = _operand(U, BIAS, DH, rm[:, None], rn[None, :], mask, stride, HAS_BIAS, GRAD, False)
    tl.store(Q + rm.to(tl.int64)[:, None] * N + rn[None, :], f8._scaled_fp8(h, scale, FMAX, ROUND_TO_2_BITS, Q),
             mask=mask)
    tl.atomic_max(AMAX.to(tl.pointer_type(tl.int32)), tl.max(tl.max(tl.abs(h).to(tl.int32, bitcast=True), 1), 0))
    if GRAD:
        tl.store(DBP + tl.program_id(0).to(tl.int64) * N + rn, tl.sum(h, 0), mask=rn < N)
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    ht = _operand(U, BIAS, DH, rm[None, :], rn[:, None], mask_t, stride, HAS_BIAS, GRAD, False)
    tl.store(QT + rn.to(tl.int64)[:, None] * M + rm[None, :], f8._scaled_fp8(ht, scale, FMAX, ROUND_TO_2_BITS, QT),
             mask=mask_t)


@triton.jit
def _trans_kernel(U, BIAS, DH, Q, QT, SCALE, AMAX, DBP, M, N, stride, FMAX: tl.constexpr,
                  ROUND_TO_2_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr, FAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    h = _operand(U, BIAS, DH, rm[:, None], rn[None, :], mask, stride, HAS_BIAS, GRAD, FAST)
    y = f8._scaled_fp8(h, scale, FMAX, ROUND_TO_2_BITS, Q)
    tl.store(Q + rm.to(tl.int64)[:, None] * N + rn[None, :], y, mask=mask)
    tl.atomic_max(AMAX.to(tl.pointer_type(tl.int32)), tl.max(tl.max(tl.abs(h).to(tl.int32, bitcast=True), 1), 0))
    if GRAD:
        tl.store(DBP + tl.program_id(0).to(tl.int64) * N + rn, tl.sum(h, 0), mask=rn < N)
    yt = tl.trans(y.to(tl.uint8, bitcast=True)).to(QT.dtype.element_ty, bitcast=True)
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(QT + rn.to(tl.int64)[:, None] * M + rm[None, :], yt, mask=mask_t)


def run_form(form, u, b, dh, scale, dtype, cfg, out):
    M, N = u.shape
    q, qt, amax, dbp = out
    amax.zero_()
    consts = dict(FMAX=float(torch.finfo(dtype).max), ROUND_TO_2_BITS=dtype == f8.E5M2, HAS_BIAS=b is not None,
                  GRAD=dh is not None)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    if form == "library":
        f8_mlp._gelu_cast_transpose_kernel[grid](u, b, u if dh is None else dh, q, qt, scale, amax, dbp, M, N,
                                                 u.stride(0), u.stride(0), **consts, **cfg)
    elif form == "recompute":
        _recompute_kernel[grid](u, b, u if dh is None else dh, q, qt, scale, amax, dbp, M, N, u.stride(0), **consts,
                                **cfg)
    else:
        _trans_kernel[grid](u, b, u if dh is None else dh, q, qt, scale, amax, dbp, M, N, u.stride(0), **consts,
                            FAST=form == "tl_trans_fast", **cfg)


CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w) for bm in (32, 64, 128) for bn in (64, 128, 256)
           for w in (4, 8) if bm * bn <= 128 * 128]


def fp8_steps_apart(got, want, dtype):
    mantissa = 3 if dtype == f8.E4M3 else 2
    g, w = got.float(), want.float()
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=1e-30))) - mantissa)
    return ((g - w).abs() / step).round()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--width", type=int, default=8192)
    a = p.parse_args()
    M, N = a.tokens, a.width
    torch.manual_seed(0)
    u = (torch.randn(M, N, device="cuda") * 1.5).to(torch.bfloat16)
    b = torch.randn(N, device="cuda") * 0.1
    dh = (torch.randn(M, N, device="cuda") * 1e-3).to(torch.bfloat16)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731
    gelu_c = torch.compile(lambda u, b: F.gelu(u + b.to(u.dtype), approximate="tanh"))
    gelu_bwd_c = torch.compile(lambda dh, u, b: (torch.ops.aten.gelu_backward(dh, u + b.to(u.dtype),
                                                                              approximate="tanh"),))
    rows = []
    for grad in (False, True):
        dtype = f8.E5M2 if grad else f8.E4M3
        ref_h = f8_gelu.gelu_operand_reference(u, b, dh if grad else None)
        scale = f8._scale_of(ref_h, dtype)
        d = dh if grad else None
        lib = f8_mlp.gelu_cast_transpose_fp8(u, b, scale, dtype, d)
        row = {"pass": "backward" if grad else "forward", "M": M, "N": N, "fp8": str(dtype)}
        row["copy_ms"] = bench(lambda: u.clone())  # 2 bytes read + 2 written per element
        moved = M * N * (2 + (2 if grad else 0) + 2)  # u (+ dh) read, q and q^T written
        row["ideal_bytes"] = moved
        row["op_ms"] = bench(lambda: f8_mlp.gelu_cast_transpose_fp8(u, b, scale, dtype, d))  # with its allocations
        if grad:
            def unfused():
                (g,) = gelu_bwd_c(dh, u, b)
                g.float().sum(0)
                return f8.cast_transpose_amax_fp8(g, scale, dtype)
        else:
            def unfused():
                return f8.cast_transpose_amax_fp8(gelu_c(u, b), scale, dtype)
        unfused()
        row["unfused_ms"] = bench(unfused)
        forms = {}
        for form in ("library", "recompute", "tl_trans", "tl_trans_fast"):
            results = []
            for cfg in CONFIGS:
                nan = 0x7F  # NaN in both FP8 formats' bytes: anything left unwritten shows
                out = (torch.full((M, N), nan, device="cuda", dtype=torch.uint8).view(dtype),
                       torch.full((N, M), nan, device="cuda", dtype=torch.uint8).view(dtype),
                       torch.zeros((), device="cuda"),
                       torch.zeros(triton.cdiv(M, cfg["BLOCK_M"]), N, device="cuda"))
                try:
                    run_form(form, u, b, d, scale, dtype, cfg, out)
                    torch.cuda.synchronize()
                    steps = fp8_steps_apart(out[0], lib[0], dtype)
                    transposed_ok = bool(torch.equal(out[1].view(torch.uint8), out[0].t().contiguous().view(torch.uint8)))
                    ms = bench(lambda: run_form(form, u, b, d, scale, dtype, cfg, out))
                    results.append({**cfg, "ms": ms, "differs": float((steps > 0).float().mean()),
                                    "max_steps": float(steps.max()), "transposed_ok": transposed_ok,
                                    "amax_rel": float((out[2] - lib[2]).abs() / lib[2])})
                except Exception as e:  # noqa: BLE001
                    results.append({**cfg, "error": f"{type(e).__name__}: {e}"[:300]})
            ok = [r for r in results if "ms" in r and r["transposed_ok"]]
            best = min(ok, key=lambda r: r["ms"]) if ok else None
            forms[form] = {"best": best, "best_GBs": moved / best["ms"] / 1e6 if best else None, "all": results}
        row["forms"] = forms
        print(json.dumps({k: v for k, v in row.items() if k != "forms"}
                         | {n: (v["best"], round(v["best_GBs"] or 0)) for n, v in forms.items()}), flush=True)
        rows.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_gelu_cast_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(
        {"benchmark": "bench_gelu_cast", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
         "triton": triton.__version__, "date": datetime.date.today().isoformat(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
