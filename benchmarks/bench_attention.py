"""Attention benchmark: every available attention backend, forward + backward, and what ``attention="auto"`` picks;
with ``--part packed``, the same for packed documents (document-causal attention).

One GPU; no new variant starts after ``--budget-s`` (210 s by default; 300 s for ``packed``):

    python benchmarks/bench_attention.py --out benchmarks/results
    python benchmarks/bench_attention.py --part packed --out benchmarks/results
    python benchmarks/bench_attention.py --smoke [--part packed]     # CPU, tiny sizes, Triton interpreter

``--part causal`` (the default):

For head dims 64 and 128 and T in 1k, 2k, 4k, 8k, 16k (causal, bf16; batch = ``--tokens`` / T, so
every call holds the same number of tokens) it times one forward + backward of:

- SDPA pinned to flash, cuDNN and memory-efficient, and SDPA's own choice (``attention="sdpa"``);
- FlexAttention, compiled, with a causal block mask (``attention="flex"``);
- FlashAttention 3 (``flash_attn_interface``) and 4 (``flash_attn.cute``) where installed;
- SDPA's flash backend with torch's switch to FA3 / FA4 (``torch.nn.attention.activate_flash_attention_impl``)
  where torch and the package have it, switched back after;
- the pack's Triton kernel (``attention="triton"``);
- ``attention="auto"``: a fresh selector per shape, whose own timing runs on its first call (the
  output check below); its choice is then timed like the rest.

Inputs have the GPT's layout: q / k / v (B, nh, T, hd) transposed from (B, T, nh, hd) projections.
Each variant's output is compared with SDPA's on its first call (relative error). Times are the median
of ``--reps`` runs, each between two CUDA events, after warm-up. Per shape the JSON records the best
backend (``auto`` and SDPA's own choice left out) and ``auto / best``, the time of auto's choice over
the best time in the same run; then ``auto_over_best_again``: auto and the best backend timed again,
interleaved call by call (the order rotating), so both see the same clocks. Variants timed one after
another drift: an H100 under minutes of attention lowers its clocks, and the slow candidates auto
times just before its own measurement (the memory-efficient backend at T = 16k) make it worse.

Writes ``bench_attention_<device>_<date>.json`` under ``--out`` (default ``$OUT`` or
``benchmarks/results``) and prints a table. A failing or missing backend is recorded with its error
and the run goes on; ``--budget-s`` stops starting new variants after that many seconds. Every
shape is timed first without the Triton kernel (it autotunes each new shape), then the Triton
kernel over the shapes while the budget lasts. ``--smoke``
runs the same code at tiny sizes on the CPU (fp32, Triton interpreter; CPU SDPA has no cuDNN or
efficient backend and FlexAttention no backward there, so those rows hold their errors).

``--part packed``: documents are the Python standard library's source files
(``lightning_perf.data.builtin``), their byte lengths + 2 (``<bos>`` / ``<eos>``) in the corpus's order,
packed back to back and cut into rows of T tokens, as ``TokenDataModule(source="builtin",
pack_documents=True)`` does; ``--doc-len N`` uses documents of N tokens instead. For T in 2k-16k (bf16,
hd 128, 16 query and 8 key/value heads by default; batch = ``--tokens`` / T) it times, each on the same
q / k / v and ``doc_ids``:

- ``sdpa_mask``: SDPA's own choice with the (B, 1, T, T) boolean mask (the reference path);
- ``efficient_mask``: SDPA pinned to its memory-efficient backend with that mask;
- ``flex``: compiled FlexAttention with the document ``mask_mod`` (the ``BlockMask`` is built per
  batch: its build time is recorded apart, ``flex_mask_build_ms``);
- ``triton``: the Triton kernel with per-token document ids (skips block pairs of other documents);
- ``auto``: what ``attention="auto"`` runs for packed documents (a fresh selector per shape);
- ``causal_sdpa``: plain causal SDPA over the same rows, what the masking costs or saves against.

Each output is compared with ``sdpa_mask``'s (relative error); also recorded, the share of (query, key)
pairs the document mask keeps of the causal triangle. The JSON,
``bench_attention_<device>_<date>_packed.json``, is rewritten after every shape.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, installed or not

if __name__ == "__main__" and "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (the script, not the library)

from lightning_perf.data.builtin import stdlib_source_files  # noqa: E402
from lightning_perf.kernels import dispatch  # noqa: E402
from lightning_perf.kernels.attention_backends import AttentionBackends, sdpa, sdpa_documents  # noqa: E402
from lightning_perf.kernels.document_mask import document_block_mask, document_mask  # noqa: E402

HEAD_DIMS = (64, 128)
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
PACKED_SEQ_LENS = (2048, 4096, 8192, 16384)


def device_tag(device: torch.device) -> str:
    """``h100`` from "NVIDIA H100 80GB HBM3", ``cpu`` without a GPU."""
    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).split()
    return (words[1] if len(words) > 1 and words[0].upper() == "NVIDIA" else words[0]).lower()


def package_versions() -> dict[str, Optional[str]]:
    out = {}
    for dist in ("flash-attn-3", "flash_attn_3", "flash-attn-4", "flash-attn", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def torch_flash_impls() -> list[str]:
    """torch's registered flash-attention implementations for SDPA ("FA3", "FA4"), where torch has the switch."""
    import torch.nn.attention as attn

    if not hasattr(attn, "list_flash_attention_impls"):
        return []
    try:
        return list(attn.list_flash_attention_impls())
    except Exception:  # noqa: BLE001 - a prototype API
        return []


@contextlib.contextmanager
def torch_flash_impl(name: str):
    """SDPA's flash backend runs ``name`` (FA3 / FA4) inside the block, the default after it."""
    import torch.nn.attention as attn

    attn.activate_flash_attention_impl(name)
    try:
        yield
    finally:
        attn.restore_flash_attention_impl()


# ---- timing ------------------------------------------------------------------------------------


def time_fwd_bwd(fn: Callable, q, k, v, warmup: int, reps: int, cuda: bool) -> dict[str, Any]:
    """Median / p10 / p90 milliseconds of ``fn(q, k, v)`` forward + backward (gradients of q, k, v)."""
    grad = None

    def step():
        nonlocal grad
        out = fn(q, k, v)
        if grad is None:
            grad = torch.randn_like(out)
        torch.autograd.grad(out, (q, k, v), grad)

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            times.append((start, end))
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in times]
    else:
        times = [1e3 * t for t in times]
    times.sort()
    pick = lambda p: times[min(len(times) - 1, int(p * (len(times) - 1) + 0.5))]  # noqa: E731
    return {"ms": statistics.median(times), "p10_ms": pick(0.1), "p90_ms": pick(0.9), "reps": reps,
            "warmup_s": warmup_s}


def time_interleaved(fns: dict[str, Callable], q, k, v, warmup: int, reps: int, cuda: bool) -> dict[str, Any]:
    """Median milliseconds of each ``fn(q, k, v)`` forward + backward, the functions called in turn
    (the order rotating every round), so each sees the same clock and allocator state."""
    grads: dict[str, torch.Tensor] = {}

    def step(name):
        out = fns[name](q, k, v)
        if name not in grads:
            grads[name] = torch.randn_like(out)
        torch.autograd.grad(out, (q, k, v), grads[name])

    names = list(fns)
    for _ in range(warmup):
        for name in names:
            step(name)
    times: dict[str, list] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(name)
                end.record()
                times[name].append((start, end))
            else:
                t = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
    out = {}
    for name, ts in times.items():
        ms = sorted(s.elapsed_time(e) for s, e in ts) if cuda else sorted(1e3 * t for t in ts)
        out[name] = {"ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "reps": len(ms)}
    return out


def causal_fwd_bwd_flops(B: int, nh: int, T: int, hd: int) -> float:
    """Forward: q k^T and p v, 2 * 2 * B * nh * T^2 * hd, halved by the causal mask; backward 2.5x that."""
    return 3.5 * 4 * B * nh * T * T * hd / 2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- variants ----------------------------------------------------------------------------------


def build_variants(backends: AttentionBackends, q, k, v, only: Optional[list[str]]) -> dict[str, dict[str, Any]]:
    """name -> {"fn": (q, k, v) -> out, "context": a context manager factory, or "error": why it cannot run}."""
    variants: dict[str, dict[str, Any]] = {"sdpa": {"fn": lambda q, k, v: sdpa(q, k, v, True)}}
    for name in dispatch.SDPA_BACKENDS:
        variants[f"sdpa_{name}"] = {"fn": lambda q, k, v, n=name: sdpa(q, k, v, True, n)}
    for name in ("flex", "fa3", "fa4"):
        reason = backends.unsupported(name, q, k, v)
        variants[name] = {"error": reason} if reason else {"fn": lambda q, k, v, n=name: backends(n, q, k, v, True)}
    for impl in torch_flash_impls():
        variants[f"sdpa_flash_{impl}"] = {"fn": lambda q, k, v: sdpa(q, k, v, True, "flash"),
                                          "context": lambda i=impl: torch_flash_impl(i)}
    reason = backends.unsupported("triton", q, k, v)
    variants["triton"] = {"error": reason} if reason else {"fn": lambda q, k, v: backends("triton", q, k, v, True)}
    variants["auto"] = {"fn": None}  # built per shape by the caller: a fresh selector
    if only:
        variants = {n: s for n, s in variants.items() if n in only or n == "auto"}
    return variants


def run_shape(args, device, dtype, hd: int, T: int, backends: AttentionBackends, deadline: float,
              only: tuple[str, ...] = (), skip: tuple[str, ...] = (), row: Optional[dict] = None) -> dict[str, Any]:
    """Time the variants of one shape (those in ``only`` if given, none in ``skip``) into ``row``
    (a new one unless given: the inputs are the same for the same shape)."""
    B = max(1, args.tokens // T)
    nh, nkv = args.heads, args.kv_heads or args.heads
    gen = torch.Generator(device=device).manual_seed(hd * 100003 + T)

    def proj(heads):  # (B, T, heads, hd) -> (B, heads, T, hd), as the GPT builds q / k / v
        return torch.randn(B, T, heads, hd, device=device, dtype=dtype, generator=gen).transpose(1, 2).requires_grad_()

    q, k, v = proj(nh), proj(nkv), proj(nkv)
    selector = dispatch.AttentionSelector(backends=backends, warmup=args.warmup, repeat=args.reps)
    auto = dispatch.KernelDispatcher(attention_selector=selector)

    def auto_fn(q, k, v):
        out = auto.attention(q, k, v, causal=True, impl="auto")
        return out if out is not None else sdpa(q, k, v, True)

    variants = build_variants(backends, q, k, v, args.backends)
    variants["auto"] = {"fn": auto_fn}
    variants = {n: s for n, s in variants.items() if (not only or n in only) and n not in skip}
    if row is None:
        row = {"head_dim": hd, "seq_len": T, "variants": {}}
    row.update(batch=B, heads=nh, kv_heads=nkv, tokens=B * T, flops=causal_fwd_bwd_flops(B, nh, T, hd))
    with torch.no_grad():
        reference = sdpa(q, k, v, True)
    cuda = device.type == "cuda"
    for name, spec in variants.items():
        res: dict[str, Any] = {}
        if "error" in spec:
            res["error"] = f"unavailable: {spec['error']}"
        elif time.time() > deadline:
            res["error"] = "skipped: time budget spent"
        else:
            context = spec.get("context", contextlib.nullcontext)
            try:
                with context():
                    with torch.no_grad():
                        res["rel_err_vs_sdpa"] = rel_err(spec["fn"](q.detach(), k.detach(), v.detach()), reference)
                    res.update(time_fwd_bwd(spec["fn"], q, k, v, args.warmup, args.reps, cuda))
                res["tflops"] = row["flops"] / (res["ms"] * 1e-3) / 1e12
            except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                res["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                if args.verbose:
                    traceback.print_exc()
        row["variants"][name] = res
        if cuda:
            torch.cuda.empty_cache()
    summarize(row)
    best = row.get("best")
    if best in variants and "ms" in row["variants"].get("auto", {}) and time.time() < deadline:
        # auto against the best backend, interleaved call by call: both see the same clocks (a GPU
        # under sustained load lowers its clocks, which skews variants timed one after another)
        spec = variants[best]
        context = spec.get("context", contextlib.nullcontext)
        with context():
            paired = time_interleaved({"auto": variants["auto"]["fn"], best: spec["fn"]}, q, k, v,
                                      args.warmup, 2 * args.reps, cuda)
        row["best_ms_again"] = paired[best]["ms"]
        row["auto_ms_paired"] = paired["auto"]["ms"]
        row["auto_over_best_again"] = paired["auto"]["ms"] / paired[best]["ms"]
    key = selector.key(q, k, True)
    if key in selector.choices:
        row["auto_choice"] = selector.choices[key]
        row["auto_choice_under_compile"] = selector.traced_choices[key]
        row["auto_timings_ms"] = selector.timings[key]
        row["auto_skipped"] = selector.skipped[key]
    summarize(row)
    return row


def summarize(row: dict[str, Any]) -> None:
    """The best backend of the row (auto and SDPA's own choice left out), auto / best, SDPA / auto."""
    timed = {n: r["ms"] for n, r in row["variants"].items() if "ms" in r and n not in ("auto", "sdpa")}
    if not timed:
        return
    best = min(timed, key=timed.get)
    row["best"], row["best_ms"] = best, timed[best]
    auto_ms = row["variants"].get("auto", {}).get("ms")
    row["auto_over_best"] = auto_ms / timed[best] if auto_ms else None
    sdpa_ms = row["variants"].get("sdpa", {}).get("ms")
    row["sdpa_over_auto"] = sdpa_ms / auto_ms if auto_ms and sdpa_ms else None


def print_table(rows: list[dict]) -> None:
    names = sorted({n for r in rows for n in r["variants"]}, key=lambda n: (n == "auto", n))
    print(f"\n{'hd':>4} {'T':>6} {'B':>4} " + " ".join(f"{n[:14]:>14}" for n in names) + "   best / auto / auto÷best")
    for r in rows:
        cells = [f"{r['variants'][n]['ms']:14.3f}" if "ms" in r["variants"].get(n, {}) else f"{'-':>14}"
                 for n in names]
        ratio = r.get("auto_over_best")
        print(f"{r['head_dim']:>4} {r['seq_len']:>6} {r.get('batch', '-'):>4} " + " ".join(cells)
              + f"   {r.get('best', '-')} / {r.get('auto_choice')} / {'-' if ratio is None else f'{ratio:.3f}'}")
    print("(ms per forward + backward; '-' = unavailable or failed, reason in the JSON)")


# ---- packed documents (--part packed) ------------------------------------------------------------


def packed_doc_ids(B: int, T: int, lengths: list[int], offset: int = 0) -> torch.Tensor:
    """(B, T) int32 ids of documents of ``lengths`` (cycled) packed back to back and cut into rows,
    numbered from 0 in each row, starting ``offset`` tokens into the stream."""
    rows, stream, i = [], [], 0
    need = B * T + offset
    while len(stream) < need:
        stream.extend([i] * lengths[i % len(lengths)])
        i += 1
    ids = torch.tensor(stream[offset:need], dtype=torch.int64).view(B, T)
    for row in ids:
        rows.append(torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), (row[1:] != row[:-1]).long()]), 0))
    return torch.stack(rows).to(torch.int32)


def kept_pairs(doc_ids: torch.Tensor) -> float:
    """Share of the causal triangle's (query, key) pairs that lie inside one document."""
    T = doc_ids.shape[1]
    counts = [torch.unique_consecutive(row, return_counts=True)[1].double() for row in doc_ids]
    inside = sum(float((c * (c + 1) / 2).sum()) for c in counts)
    return inside / (doc_ids.shape[0] * T * (T + 1) / 2)


def packed_variants(backends: AttentionBackends, doc_ids: torch.Tensor) -> dict[str, Callable]:
    mask = document_mask(doc_ids)
    disp = dispatch.KernelDispatcher(attention_selector=dispatch.AttentionSelector(backends=AttentionBackends()))
    return {
        "sdpa_mask": lambda q, k, v: sdpa_documents(q, k, v, doc_ids, mask=mask),
        "efficient_mask": lambda q, k, v: sdpa_documents(q, k, v, doc_ids, "efficient", mask=mask),
        "flex": lambda q, k, v: backends("flex", q, k, v, True, doc_ids=doc_ids),
        "triton": lambda q, k, v: backends("triton", q, k, v, True, doc_ids=doc_ids),
        "auto": lambda q, k, v: disp.attention(q, k, v, impl="auto", doc_ids=doc_ids),
        "causal_sdpa": lambda q, k, v: sdpa(q, k, v, True),
    }


def run_packed_shape(args, device, dtype, T: int, lengths: list[int], deadline: float) -> dict[str, Any]:
    B = max(1, args.tokens // T)
    nh, nkv, hd = args.heads, args.kv_heads, args.head_dims[0]
    gen = torch.Generator().manual_seed(T)
    doc_ids = packed_doc_ids(B, T, lengths, offset=int(torch.randint(0, 10_000, (1,), generator=gen))).to(device)
    counts = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in doc_ids.cpu()])
    row: dict[str, Any] = {"T": T, "B": B, "nh": nh, "nkv": nkv, "hd": hd, "dtype": str(dtype),
                           "documents_per_row": counts.numel() / B, "mean_document_tokens": float(counts.float().mean()),
                           "kept_pair_share": kept_pairs(doc_ids.cpu()), "variants": {}}
    q, k, v = (torch.randn(B, n, T, hd, device=device, dtype=dtype).requires_grad_() for n in (nh, nkv, nkv))
    backends = AttentionBackends()
    if device.type == "cuda":
        t0 = time.perf_counter()
        for _ in range(3):
            document_block_mask(doc_ids)
        torch.cuda.synchronize()
        row["flex_mask_build_ms"] = 1e3 * (time.perf_counter() - t0) / 3
    ref = None
    for name, fn in packed_variants(backends, doc_ids).items():
        if time.time() > deadline:
            row["variants"][name] = {"error": "skipped: --budget-s reached"}
            continue
        if device.type == "cpu" and name in ("flex", "efficient_mask"):
            row["variants"][name] = {"error": "not on CPU (FlexAttention has no CPU backward; no efficient backend)"}
            continue
        try:
            with torch.no_grad():
                out = fn(q.detach(), k.detach(), v.detach())
            if name == "sdpa_mask":
                ref = out
            res = time_fwd_bwd(fn, q, k, v, args.warmup, args.reps, device.type == "cuda")
            if ref is not None and name != "causal_sdpa":
                res["rel_err_vs_sdpa_mask"] = rel_err(out, ref)
            row["variants"][name] = res
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            row["variants"][name] = {"error": f"{type(err).__name__}: {err}"[:500],
                                     "trace": traceback.format_exc(limit=3)[-1500:]}
        print(f"T={T} {name}: {row['variants'][name].get('ms', row['variants'][name].get('error'))}", flush=True)
    return row


def main_packed(args, device, dtype, t_start: float) -> int:
    lengths = [args.doc_len] if args.doc_len else [size + 2 for _, size in stdlib_source_files()]
    if args.smoke and not args.doc_len:
        lengths = [min(n, 50) for n in lengths[:64]]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"bench_attention_{device_tag(device)}_{dt.date.today():%Y%m%d}_packed{args.tag}"
                      f"{'_smoke' if args.smoke else ''}.json")
    result: dict[str, Any] = {
        "benchmark": "bench_attention", "part": "packed", "argv": sys.argv[1:],
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "smoke": args.smoke,
        "documents": f"{args.doc_len} tokens each" if args.doc_len else "stdlib source files (bytes + 2)",
        "rows": [],
    }
    for T in args.seq_lens:
        result["rows"].append(run_packed_shape(args, device, dtype, T, lengths, t_start + args.budget_s))
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--part", choices=("causal", "packed"), default="causal",
                   help="causal attention per backend, or document-causal attention on packed documents")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU ok (fp32, Triton interpreter)")
    p.add_argument("--head-dims", type=int, nargs="*", default=None,
                   help=f"default {HEAD_DIMS}; packed: the first, default 128")
    p.add_argument("--seq-lens", type=int, nargs="*", default=None,
                   help=f"default {SEQ_LENS}; packed {PACKED_SEQ_LENS}")
    p.add_argument("--tokens", type=int, default=None, help="tokens per call, batch = tokens / T (default 32768)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key / value heads (default: --heads, fewer = GQA; packed: 8)")
    p.add_argument("--doc-len", type=int, default=None,
                   help="packed: documents of this many tokens instead of the stdlib's files")
    p.add_argument("--backends", nargs="*", default=None,
                   help="variants to time (auto always): sdpa sdpa_flash sdpa_cudnn sdpa_efficient flex fa3 fa4 "
                        "sdpa_flash_FA3 sdpa_flash_FA4 triton")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting variants after this (default 210; packed 300)")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    args = p.parse_args(argv)

    t_start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
        return 2
    smoke = args.smoke
    if args.part == "packed":
        if smoke:
            args.seq_lens, args.tokens, args.heads, args.kv_heads, args.head_dims = [64, 128], 128, 2, 1, [16]
        args.seq_lens = args.seq_lens or list(PACKED_SEQ_LENS)
        args.tokens, args.heads = args.tokens or 32768, args.heads or 16
        args.kv_heads, args.head_dims = args.kv_heads or 8, args.head_dims or [128]
        args.reps = args.reps or (2 if smoke else 20)
        args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
        args.budget_s = args.budget_s if args.budget_s is not None else 300.0
        return main_packed(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32, t_start)
    head_dims = args.head_dims or ((16, 32) if smoke else HEAD_DIMS)
    seq_lens = args.seq_lens or ((32, 64) if smoke else SEQ_LENS)
    args.tokens = args.tokens or (256 if smoke else 32768)
    args.heads = args.heads or (2 if smoke else 16)
    args.reps = args.reps or (2 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    budget = args.budget_s if args.budget_s is not None else (600.0 if smoke else 210.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # FlexAttention is compiled once per shape: more shapes than Dynamo's default recompile limit
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    tag = device_tag(device)
    import torch.nn.attention as attn

    result: dict[str, Any] = {
        "benchmark": "bench_attention",
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "packages": package_versions(),
        "torch_flash_impl_switch": hasattr(attn, "activate_flash_attention_impl"),
        "torch_flash_impls": torch_flash_impls(),
        "python": platform.python_version(),
        "smoke": smoke,
        "config": {"head_dims": list(head_dims), "seq_lens": list(seq_lens), "tokens_per_call": args.tokens,
                   "heads": args.heads, "kv_heads": args.kv_heads or args.heads, "causal": True,
                   "dtype": str(dtype), "reps": args.reps, "warmup": args.warmup, "budget_s": budget,
                   "backends": args.backends,
                   "timing": "median of reps, each forward + backward between two CUDA events, after warm-up"},
        "rows": [],
    }
    print(f"device {result['device']}, torch {torch.__version__}, packages {result['packages']}, "
          f"torch flash impls {result['torch_flash_impls']}", flush=True)
    backends = AttentionBackends()  # one FlexAttention compile per shape, shared by "flex" and "auto"
    deadline = t_start + budget
    json_path = out_dir / f"bench_attention_{tag}_{date}{args.tag}{'_smoke' if smoke else ''}.json"

    def save() -> None:  # after every shape: a run cut short keeps what it measured
        result["wall_s"] = time.time() - t_start
        json_path.write_text(json.dumps(result, indent=1, default=str))

    # the libraries and auto first over every shape, then our Triton kernel (opt-in, and the slowest to
    # start: it autotunes each new shape) while the budget lasts
    for phase, only, skip in (("libraries", (), ("triton",)), ("triton", ("triton",), ())):
        for i, (hd, T) in enumerate((hd, T) for hd in head_dims for T in seq_lens):
            if phase == "libraries":
                result["rows"].append({"head_dim": hd, "seq_len": T, "variants": {}})
            row = result["rows"][i]
            try:
                run_shape(args, device, dtype, hd, T, backends, deadline, only=only, skip=skip, row=row)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory building the inputs
                row.setdefault("errors", []).append(f"{phase}: {type(err).__name__}: {err}")
                traceback.print_exc()
            row[f"elapsed_s_{phase}"] = time.time() - t_start
            print(f"[{time.time() - t_start:6.1f}s] hd{hd} T={T} {phase}: "
                  + ", ".join(f"{n}={r['ms']:.3f}" if "ms" in r else f"{n}=-" for n, r in row["variants"].items())
                  + f" | best {row.get('best')}, auto {row.get('auto_choice')}"
                  + (f" x{row['auto_over_best']:.3f}" if row.get("auto_over_best") else "")
                  + (f", interleaved x{row['auto_over_best_again']:.3f}" if row.get("auto_over_best_again") else ""),
                  flush=True)
            save()
    save()
    print_table(result["rows"])
    print(f"\nwrote {json_path} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
