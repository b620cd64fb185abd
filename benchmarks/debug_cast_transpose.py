"""Which tile configurations of the FP8 cast-and-transpose kernel write q^T correctly (GPU only).

    python benchmarks/debug_cast_transpose.py --out DIR

On an H200 (Triton 3.6) the kernel's transposed output was wrong for fp32 sources at some
shapes while q itself and bf16 sources were right. This runs every configuration of the
library kernel and of two alternative formulations, for fp32 and bf16 sources, against the
PyTorch reference, and writes the mismatch counts as JSON:

- ``library``: ``lightning_perf.kernels.ops.fp8_linear._cast_transpose_kernel`` (the fp32 tile
  transposed in registers / shared memory, then cast);
- ``reload``: no in-kernel transpose: the transposed tile is loaded again from global memory in
  the transposed order and stored directly;
- ``via16``: the tile is converted to the source's 16-bit type before the transpose when the source
  is 16-bit, else transposed as fp32 bits (integer view) and bit-cast back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_perf.kernels.ops import fp8_linear as f8  # noqa: E402


@triton.jit
def _round2(y, ROUND_TO_2_BITS: tl.constexpr):
    if ROUND_TO_2_BITS:
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0xFFFFF + ((b >> 21) & 1)) & 0xFFE00000
        y = b.to(tl.float32, bitcast=True)
    return y


@triton.jit
def _reload_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _round2(tl.clamp(x * scale, -FMAX, FMAX), ROUND_TO_2_BITS)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], y.to(Q.dtype.element_ty), mask=mask)
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    xt = tl.load(X + rm64[None, :] * stride_xm + rn64[:, None], mask=mask_t, other=0.0).to(tl.float32)
    yt = _round2(tl.clamp(xt * scale, -FMAX, FMAX), ROUND_TO_2_BITS)
    tl.store(QT + rn64[:, None] * M + rm64[None, :], yt.to(QT.dtype.element_ty), mask=mask_t)


@triton.jit
def _bits_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _round2(tl.clamp(x * scale, -FMAX, FMAX), ROUND_TO_2_BITS)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], y.to(Q.dtype.element_ty), mask=mask)
    yt = tl.trans(y.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    tl.store(QT + rn64[:, None] * M + rm64[None, :], yt.to(QT.dtype.element_ty), mask=tl.trans(mask))


def run(kernel, t, scale, dtype, cfg):
    M, N = t.shape
    q = torch.full((M, N), 0x7F, dtype=torch.uint8, device=t.device).view(dtype)  # poison (NaN in e4m3)
    qt = torch.full((N, M), 0x7F, dtype=torch.uint8, device=t.device).view(dtype)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    kernel[grid](t, q, qt, scale, M, N, t.stride(0), FMAX=float(torch.finfo(dtype).max),
                 ROUND_TO_2_BITS=dtype == f8.E5M2, **cfg)
    torch.cuda.synchronize()
    return q, qt


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = parser.parse_args()
    kernels = {"library": f8._cast_transpose_kernel, "reload": _reload_kernel, "bits": _bits_kernel}
    rows = []
    for (M, N) in [(16384, 2048), (33, 48), (1000, 8192), (256, 256)]:
        for src in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            t = (torch.randn(M, N, device="cuda") * 3).to(src)
            for dtype in (f8.E4M3, f8.E5M2):
                scale = f8._scale_of(t, dtype)
                want, want_t = f8.cast_transpose_fp8_reference(t, scale, dtype)
                for name, kernel in kernels.items():
                    for cfg in f8._CT_CONFIGS_GPU:
                        try:
                            q, qt = run(kernel, t, scale, dtype, cfg)
                            bad_q = int((q.view(torch.uint8) != want.view(torch.uint8)).sum())
                            bad_t = int((qt.view(torch.uint8) != want_t.view(torch.uint8)).sum())
                            ms = triton.testing.do_bench(lambda: run(kernel, t, scale, dtype, cfg), warmup=5, rep=20) \
                                if M * N >= 1 << 24 else None
                            err = None
                        except Exception as e:  # noqa: BLE001
                            bad_q = bad_t = -1
                            ms, err = None, f"{type(e).__name__}: {e}"[:300]
                        rows.append({"M": M, "N": N, "src": str(src), "fp8": str(dtype), "kernel": name, **cfg,
                                     "bad_q": bad_q, "bad_qt": bad_t, "ms": ms, "error": err})
                        print(json.dumps(rows[-1]), flush=True)
    summary: dict = {}
    for r in rows:
        key = f"{r['kernel']} {r['src']}"
        s = summary.setdefault(key, {"cases": 0, "wrong": 0, "wrong_cfgs": set()})
        s["cases"] += 1
        if r["bad_q"] or r["bad_qt"]:
            s["wrong"] += 1
            s["wrong_cfgs"].add(f"{r['BLOCK_M']}x{r['BLOCK_N']}w{r['num_warps']}")
    for s in summary.values():
        s["wrong_cfgs"] = sorted(s["wrong_cfgs"])
    print(json.dumps(summary, indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"debug_cast_transpose_{stamp}.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
         "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
