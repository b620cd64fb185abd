"""Packed-document attention: document-causal forward + backward by FlexAttention, SDPA with a mask and
the pack's Triton kernel, against plain causal attention over the same tokens.

    python benchmarks/bench_packed_attention.py --out benchmarks/results
    python benchmarks/bench_packed_attention.py --smoke          # CPU, tiny sizes, Triton interpreter

Documents: the Python standard library's source files (``lightning_perf.data.builtin``), their
byte lengths + 2 (``<bos>`` / ``<eos>``) in the corpus's order, packed back to back and cut into rows
of T tokens, as ``TokenDataModule(source="builtin", pack_documents=True)`` does; ``--doc-len N``
uses documents of N tokens instead. For T in 2k-16k (bf16, hd 128, 16 query and 8 key/value heads;
batch = ``--tokens`` / T) it times, each on the same q / k / v and ``doc_ids``:

- ``sdpa_mask``: SDPA's own choice with the (B, 1, T, T) boolean mask (the reference path);
- ``efficient_mask``: SDPA pinned to its memory-efficient backend with that mask;
- ``flex``: compiled FlexAttention with the document ``mask_mod`` (the ``BlockMask`` is built per
  batch: its build time is recorded apart, ``flex_mask_build``);
- ``triton``: the Triton kernel with per-token document ids (skips block pairs of other documents);
- ``auto``: what ``attention="auto"`` runs for packed documents (a fresh selector per shape);
- ``causal_sdpa``: plain causal SDPA over the same rows, what the masking costs or saves against.

Each output is compared with ``sdpa_mask``'s (relative error). Times are the median of ``--reps``
fwd + bwd runs between CUDA events. The JSON, ``bench_packed_attention_<device>_<date>.json`` under
``--out`` (default ``$OUT`` or ``benchmarks/results``), is rewritten after every shape; also the share
of (query, key) pairs the document mask keeps against the causal triangle.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, installed or not

if __name__ == "__main__" and "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from bench_attention import device_tag, rel_err, time_fwd_bwd  # noqa: E402

from lightning_perf.data.builtin import stdlib_source_files  # noqa: E402
from lightning_perf.kernels import dispatch  # noqa: E402
from lightning_perf.kernels.attention_backends import AttentionBackends, sdpa, sdpa_documents  # noqa: E402
from lightning_perf.kernels.document_mask import document_block_mask, document_mask  # noqa: E402

SEQ_LENS = (2048, 4096, 8192, 16384)


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


def variants(backends: AttentionBackends, doc_ids: torch.Tensor) -> dict[str, Callable]:
    mask = document_mask(doc_ids)
    selector = dispatch.AttentionSelector(backends=AttentionBackends())
    disp = dispatch.KernelDispatcher(attention_selector=selector)
    return {
        "sdpa_mask": lambda q, k, v: sdpa_documents(q, k, v, doc_ids, mask=mask),
        "efficient_mask": lambda q, k, v: sdpa_documents(q, k, v, doc_ids, "efficient", mask=mask),
        "flex": lambda q, k, v: backends("flex", q, k, v, True, doc_ids=doc_ids),
        "triton": lambda q, k, v: backends("triton", q, k, v, True, doc_ids=doc_ids),
        "auto": lambda q, k, v: disp.attention(q, k, v, impl="auto", doc_ids=doc_ids),
        "causal_sdpa": lambda q, k, v: sdpa(q, k, v, True),
    }


def run_shape(args, device, dtype, T: int, lengths: list[int], deadline: float) -> dict[str, Any]:
    B = max(1, args.tokens // T)
    nh, nkv, hd = args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(T)
    doc_ids = packed_doc_ids(B, T, lengths, offset=int(torch.randint(0, 10_000, (1,), generator=gen))).to(device)
    counts = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in doc_ids.cpu()])
    row: dict[str, Any] = {"T": T, "B": B, "nh": nh, "nkv": nkv, "hd": hd, "dtype": str(dtype),
                           "documents_per_row": counts.numel() / B, "mean_document_tokens": float(counts.float().mean()),
                           "kept_pair_share": kept_pairs(doc_ids.cpu()), "variants": {}}
    q, k, v = (torch.randn(B, n, T, hd, device=device, dtype=dtype, generator=None).requires_grad_()
               for n in (nh, nkv, nkv))
    backends = AttentionBackends()
    if device.type == "cuda":
        t0 = time.perf_counter()
        for _ in range(3):
            document_block_mask(doc_ids)
        torch.cuda.synchronize()
        row["flex_mask_build_ms"] = 1e3 * (time.perf_counter() - t0) / 3
    ref = None
    for name, fn in variants(backends, doc_ids).items():
        if time.monotonic() > deadline:
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


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    p.add_argument("--tokens", type=int, default=32768, help="tokens per call (B = tokens / T)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-len", type=int, default=None, help="documents of this many tokens instead of the stdlib's")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (fp32, Triton interpreter)")
    p.add_argument("--tag", default="", help="suffix of the result file's name, e.g. _after")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        args.seq_lens, args.tokens, args.heads, args.kv_heads, args.head_dim = [64, 128], 128, 2, 1, 16
        args.reps, args.warmup = 2, 1
    lengths = [args.doc_len] if args.doc_len else [size + 2 for _, size in stdlib_source_files()]
    if args.smoke and not args.doc_len:
        lengths = [min(n, 50) for n in lengths[:64]]
    deadline = time.monotonic() + args.budget_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_packed_attention_{device_tag(device)}_{dt.date.today():%Y%m%d}{args.tag}.json"
    result: dict[str, Any] = {
        "script": "bench_packed_attention.py", "argv": sys.argv[1:], "device": torch.cuda.get_device_name(0)
        if cuda else platform.processor() or "cpu", "torch": torch.__version__, "smoke": args.smoke,
        "documents": f"{args.doc_len} tokens each" if args.doc_len else "stdlib source files (bytes + 2)",
        "rows": [],
    }
    for T in args.seq_lens:
        result["rows"].append(run_shape(args, device, dtype, T, lengths, deadline))
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
