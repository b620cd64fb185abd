"""Which tile configurations of the FP8 cast-and-transpose kernel write q^T correctly (GPU only).

    python benchmarks/debug_cast_transpose.py --out DIR

On an H200 (Triton 3.6) the kernel's first form, which transposed the loaded tile on chip
(``tl.trans``) for the transposed store, wrote q^T wrongly for fp32 sources in 56 of 64 (shape,
configuration) cases while q and bf16 sources were right; a form that loads the tile a second
time in transposed order was exact everywhere and became the library kernel
(``debug_cast_transpose_20261122-102140.json``: "library" was the on-chip form then, "reload"
the second-load form). This runs every configuration of the library kernel and of the on-chip
form, for fp32 and bf16 sources, against the PyTorch reference, and writes the mismatch counts
(and times) as JSON.
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
def _on_chip_transpose_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first form: one load, the tile transposed on chip (as fp32 bits) for the second store."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], f8._scaled_fp8(x, scale, FMAX, ROUND_TO_2_BITS, Q), mask=mask)
    xt = tl.trans(x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    tl.store(QT + rn64[:, None] * M + rm64[None, :], f8._scaled_fp8(xt, scale, FMAX, ROUND_TO_2_BITS, QT),
             mask=tl.trans(mask))


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
    kernels = {"library": f8._cast_transpose_kernel, "on_chip_transpose": _on_chip_transpose_kernel}
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
