"""Forms of the FP8 scale-cast-transpose kernel against each other and the memory bandwidth (GPU only).

    python benchmarks/bench_cast_transpose.py --out DIR

The FP8 linears of the gpt-1.3b step move ~55 GB per step through this kernel (every block input
and output gradient: read once, written as q and q^T), so its bandwidth decides much of what FP8
costs over the bf16 step. Per activation shape of that step (tokens 16384; fp32 LayerNorm outputs,
bf16 elsewhere) this times:

- ``library``: the library kernel (the tile loaded twice, the second time in transposed order);
- ``fp8_trans``: one load, the tile cast once, the FP8 tile transposed on chip (as bytes);
- ``n_major``: the library kernel with the grid walking tiles along N first;
- ``strip``: each program walks a column strip of tiles in a software-pipelined loop;

each over the library's configurations, checked byte for byte against the PyTorch reference, and
beside them a plain copy of the input (the bandwidth ceiling), torch.compile of the reference cast
+ transpose, and the amax reduction that precedes every cast (eager and compiled). JSON to --out.
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
from lightning_perf.kernels.ops import fp8_casts as f8  # noqa: E402


@triton.jit
def _fp8_trans_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    y = f8._scaled_fp8(x, scale, FMAX, ROUND_TO_2_BITS, Q)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], y, mask=mask)
    yt = tl.trans(y.to(tl.uint8, bitcast=True)).to(QT.dtype.element_ty, bitcast=True)
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(QT + rn64[:, None] * M + rm64[None, :], yt, mask=mask_t)


@triton.jit
def _n_major_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], f8._scaled_fp8(x, scale, FMAX, ROUND_TO_2_BITS, Q), mask=mask)
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    xt = tl.load(X + rm64[None, :] * stride_xm + rn64[:, None], mask=mask_t, other=0.0).to(tl.float32)
    tl.store(QT + rn64[:, None] * M + rm64[None, :], f8._scaled_fp8(xt, scale, FMAX, ROUND_TO_2_BITS, QT), mask=mask_t)


@triton.jit
def _strip_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    first = tl.program_id(1) * TILES * BLOCK_M
    for start in tl.range(first, first + TILES * BLOCK_M, BLOCK_M, num_stages=STAGES):
        rm = start + tl.arange(0, BLOCK_M)
        rm64 = rm.to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(Q + rm64[:, None] * N + rn64[None, :], f8._scaled_fp8(x, scale, FMAX, ROUND_TO_2_BITS, Q),
                 mask=mask)
        mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        xt = tl.load(X + rm64[None, :] * stride_xm + rn64[:, None], mask=mask_t, other=0.0).to(tl.float32)
        tl.store(QT + rn64[:, None] * M + rm64[None, :], f8._scaled_fp8(xt, scale, FMAX, ROUND_TO_2_BITS, QT),
                 mask=mask_t)


def launch(name, t, q, qt, scale, dtype, cfg):
    M, N = t.shape
    common = dict(FMAX=float(torch.finfo(dtype).max), ROUND_TO_2_BITS=dtype == f8.E5M2)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if name == "library":
        f8._cast_transpose_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            t, q, qt, scale, scale, M, N, t.stride(0), **common, WITH_AMAX=False, **cfg)
    elif name == "fp8_trans":
        _fp8_trans_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](t, q, qt, scale, M, N, t.stride(0), **common, **cfg)
    elif name == "n_major":
        _n_major_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](t, q, qt, scale, M, N, t.stride(0), **common, **cfg)
    elif name == "strip":
        c = dict(cfg)
        tiles = c.pop("TILES")
        _strip_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm * tiles))](
            t, q, qt, scale, M, N, t.stride(0), **common, TILES=tiles, **c)
    else:
        raise ValueError(name)


def configs(name):
    base = list(f8._CT_CONFIGS_GPU)
    if name == "strip":
        return [dict(c, TILES=16, STAGES=stages) for c in base for stages in (2, 3)]
    if name == "library":
        return base + [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w) for bm, bn, w in
                       ((32, 128, 4), (128, 32, 4), (256, 64, 8), (64, 256, 8), (32, 64, 2), (64, 32, 2))]
    return base


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--tokens", type=int, default=16384)
    a = parser.parse_args()
    dev = torch.device("cuda")
    T = a.tokens
    shapes = [(T, 2048, torch.float32), (T, 2048, torch.bfloat16), (T, 6144, torch.bfloat16),
              (T, 8192, torch.bfloat16)]
    rows = []
    compiled_ref = torch.compile(f8.cast_transpose_fp8_reference)
    amax_c = torch.compile(lambda t: t.abs().amax())
    for (M, N, src) in shapes:
        torch.manual_seed(0)
        t = (torch.randn(M, N, device=dev) * 3).to(src)
        for dtype in (f8.E4M3, f8.E5M2):
            scale = f8._scale_of(t, dtype)
            want, want_t = f8.cast_transpose_fp8_reference(t, scale, dtype)
            ideal = M * N * (t.element_size() + 2)  # read once, q and q^T written once
            row = {"M": M, "N": N, "src": str(src), "fp8": str(dtype), "ideal_bytes": ideal, "variants": {}}
            copy_ms = triton.testing.do_bench(lambda: t.clone(), warmup=10, rep=50)
            row["copy_ms"] = copy_ms
            row["copy_GBs"] = 2 * M * N * t.element_size() / copy_ms / 1e6
            try:
                compiled_ref(t, scale, dtype)
                row["compiled_reference_ms"] = triton.testing.do_bench(lambda: compiled_ref(t, scale, dtype), warmup=10,
                                                                       rep=50)
            except Exception as e:  # noqa: BLE001
                row["compiled_reference_error"] = f"{type(e).__name__}: {e}"[:300]
            row["amax_eager_ms"] = triton.testing.do_bench(lambda: t.abs().amax(), warmup=10, rep=50)
            amax_c(t)
            row["amax_compiled_ms"] = triton.testing.do_bench(lambda: amax_c(t), warmup=10, rep=50)
            row["op_ms"] = triton.testing.do_bench(lambda: f8.cast_transpose_fp8(t, scale, dtype), warmup=10, rep=50)
            for name in ("library", "fp8_trans", "n_major", "strip"):
                results = []
                for cfg in configs(name):
                    q = torch.full((M, N), 0x7F, dtype=torch.uint8, device=dev).view(dtype)
                    qt = torch.full((N, M), 0x7F, dtype=torch.uint8, device=dev).view(dtype)
                    try:
                        launch(name, t, q, qt, scale, dtype, cfg)
                        torch.cuda.synchronize()
                        bad = int((q.view(torch.uint8) != want.view(torch.uint8)).sum()
                                  + (qt.view(torch.uint8) != want_t.view(torch.uint8)).sum())
                        ms = triton.testing.do_bench(lambda: launch(name, t, q, qt, scale, dtype, cfg), warmup=10,
                                                     rep=50)
                        results.append({**cfg, "ms": ms, "bad": bad})
                    except Exception as e:  # noqa: BLE001
                        results.append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
                ok = [r for r in results if r.get("bad") == 0]
                best = min(ok, key=lambda r: r["ms"]) if ok else None
                row["variants"][name] = {"best": best, "best_GBs": ideal / best["ms"] / 1e6 if best else None,
                                         "wrong_configs": sum(1 for r in results if r.get("bad")),
                                         "all": results}
            print(json.dumps({k: v for k, v in row.items() if k != "variants"}
                             | {n: (v["best"], round(v["best_GBs"] or 0), v["wrong_configs"])
                                for n, v in row["variants"].items()}), flush=True)
            rows.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"bench_cast_transpose_{stamp}.json").write_text(json.dumps(
        {"benchmark": "bench_cast_transpose", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
         "triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
