"""FP8 linears (``GPTConfig(fp8=True)``) against bf16, same run, one GPU; plus the LM-head loss chunking.

Three parts, each written to one JSON:
1. ``linears``: one linear's forward + backward at the gpt-1.3b shapes (16384 tokens), compiled,
   ``fp8_linear`` against ``F.linear`` under bf16 autocast (the baseline's matmul).
2. ``convergence``: the same model trained from the same seed on the built-in corpus (real text, bytes)
   in bf16 and with fp8 linears; loss every step, so the curves can be compared point by point.
3. ``flce_chunks``: ``fused_linear_cross_entropy`` forward + backward at gpt-1.3b's head
   (16384 x 2048, vocabulary 50304) for several chunk sizes against torch.compile of the reference:
   the time each chunking costs and its extra memory.

    python benchmarks/bench_fp8.py --out $OUT
    python benchmarks/bench_fp8.py --smoke          # CPU, tiny shapes, checks the code paths
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _time(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_linears(device, M: int, shapes, iters: int) -> list[dict]:
    from lightning_perf.kernels.ops.fp8_linear import fp8_linear

    cuda = device.type == "cuda"
    rows = []
    for K, N in shapes:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16 if cuda else torch.float32, requires_grad=True)
        w = torch.randn(N, K, device=device, dtype=torch.float32, requires_grad=True)
        g = torch.randn(M, N, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
        row = {"M": M, "K": K, "N": N, "flop_fwd_bwd": 6 * M * K * N}
        for name, fn in (("bf16", F.linear), ("fp8", lambda a, b: fp8_linear(a, b))):
            step_fn = torch.compile(fn) if cuda else fn

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    y = step_fn(x, w)
                y.backward(g)
                x.grad = w.grad = None

            try:
                t = _time(step, iters, 3, cuda)
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_tflops"] = row["flop_fwd_bwd"] / t / 1e12
            except Exception as err:
                row[f"{name}_error"] = f"{type(err).__name__}: {err}"
        if "bf16_ms" in row and "fp8_ms" in row:
            row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


CONV_RUNS = {
    # name: (fp8 linears, the Triton cast-and-transpose kernel (False: its PyTorch reference))
    "bf16": (False, True),
    "fp8": (True, True),
    "fp8-reference-cast": (True, False),
}


def bench_convergence(device, preset: str, seq_len: int, batch: int, steps: int, lr: float,
                      runs=("bf16", "fp8")) -> dict:
    from lightning_perf.data import TokenDataModule
    from lightning_perf.kernels.ops import fp8_linear as f8
    from lightning_perf.models import GPT, GPTConfig

    cuda = device.type == "cuda"
    dm = TokenDataModule(source="builtin", seq_len=seq_len, batch_size=batch, num_workers=0)
    dm.setup("fit")
    out = {"preset": preset, "seq_len": seq_len, "batch": batch, "steps": steps, "lr": lr}
    kernel_ok = f8._cast_transpose_ok
    for key in runs:
        fp8, use_kernel = CONV_RUNS[key]
        f8._cast_transpose_ok = kernel_ok if use_kernel else (lambda t: False)
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(preset, vocab_size=dm.vocab_size, block_size=seq_len, fp8=fp8)
        with torch.device(device):
            model = GPT(cfg)
        compiled = torch.compile(model) if cuda else model
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
        warm = max(1, steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
        losses = []
        it = iter(dm.train_dataloader())
        t0 = time.time()
        for step in range(steps):
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(dm.train_dataloader())
                x, y = next(it)
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = compiled(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        losses = [float(v) for v in torch.stack(losses).cpu()]
        val = []
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            for i, (x, y) in enumerate(dm.val_dataloader()):
                if i >= 20:
                    break
                val.append(float(compiled(x.to(device), y.to(device))))
        out[key] = {"losses": losses, "last_20_mean": statistics.fmean(losses[-20:]),
                    "val_loss": statistics.fmean(val) if val else None, "wall_s": time.time() - t0}
        print(json.dumps({key: {k: v for k, v in out[key].items() if k != "losses"}}), flush=True)
        model = compiled = opt = None  # free before the next variant
    f8._cast_transpose_ok = kernel_ok
    for a, b in (("bf16", "fp8"), ("fp8", "fp8-reference-cast")):
        if a in out and b in out:
            x, y = out[a]["losses"], out[b]["losses"]
            out[f"max_abs_diff_{a}_vs_{b}"] = max(abs(p - q) for p, q in zip(x, y))
            out[f"max_abs_diff_{a}_vs_{b}_last_half"] = max(abs(p - q) for p, q in zip(x[len(x) // 2:], y[len(y) // 2:]))
    return out


def bench_flce_chunks(device, N: int, d: int, V: int, chunks, iters: int) -> list[dict]:
    from lightning_perf.kernels.ops import fused_linear_cross_entropy as flce

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    x = (torch.randn(N, d, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(V, d, device=device) * 0.02).requires_grad_()
    t = torch.randint(0, V, (N,), device=device)
    rows = []

    def measure(name, fn):
        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = fn()
            loss.backward()
            x.grad = w.grad = None

        step()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        sec = _time(step, iters, 2, cuda)
        row = {"variant": name, "ms": sec * 1e3,
               "extra_mem_gb": (torch.cuda.max_memory_allocated() - base) / 1e9 if cuda else None}
        rows.append(row)
        print(json.dumps(row), flush=True)

    ref = torch.compile(flce.linear_cross_entropy_reference) if cuda else flce.linear_cross_entropy_reference
    measure("torch.compile reference", lambda: ref(x, w, t))
    original = flce._chunked
    for c in chunks:
        def chunked(*args, c=c, **kw):
            kw["chunk_rows"] = c
            return original(*args, **kw)

        flce._chunked = chunked
        try:
            measure(f"chunk {c}", lambda: flce.fused_linear_cross_entropy(x, w, t))
        finally:
            flce._chunked = original
    measure(f"default chunk {flce._chunk_rows(N, V, 2)}", lambda: flce.fused_linear_cross_entropy(x, w, t))
    return rows


_ND = {"triton.prefer_nd_tiling": True}
_CD = {"coordinate_descent_tuning": True}
STEP_VARIANTS = {
    # name: (GPTConfig overrides, fp8_linear's forward fast accumulation[, Inductor options])
    "bf16": ({}, True),
    "fp8": ({"fp8": True}, True),
    "fp8-exact-forward-accum": ({"fp8": True}, False),
    "fp8-fused-qkv": ({"fp8": True, "fused_qkv": True}, True),
    "bf16-fused-qkv": ({"fused_qkv": True}, True),
    "bf16-nd-tiling": ({}, True, _ND),
    "fp8-fused-qkv-nd-tiling": ({"fp8": True, "fused_qkv": True}, True, _ND),
    "bf16-coordinate-descent": ({}, True, _CD),
    "fp8-fused-qkv-coordinate-descent": ({"fp8": True, "fused_qkv": True}, True, _CD),
    "fp8-fused-qkv-nd-tiling-coordinate-descent": ({"fp8": True, "fused_qkv": True}, True, {**_ND, **_CD}),
}


def bench_step(device, preset: str, seq_len: int, batch: int, variants, steps: int, warmup: int,
               profile_dir: Path) -> list[dict]:
    """A plain loop (bf16 autocast, whole-model compile, fused AdamW) per variant; one profiled step each."""
    from lightning_perf.kernels.ops import fp8_linear as f8
    from lightning_perf.models import GPT, GPTConfig
    from lightning_perf.perf.gpu_time import gpu_time_breakdown

    cuda = device.type == "cuda"
    rows = []
    for name in variants:
        overrides, fast, *rest = STEP_VARIANTS[name]
        options = rest[0] if rest else None
        f8.fp8_linear.__kwdefaults__["fast_accum"] = fast
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(preset, block_size=seq_len, **overrides)
        with torch.device(device):
            model = GPT(cfg)
        compiled = torch.compile(model, options=options) if cuda else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
        y = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = compiled(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        sec = _time(step, steps, warmup, cuda)
        row = {"variant": name, "config": overrides, "fast_accum_forward": fast, "inductor_options": options,
               "step_ms": sec * 1e3,
               "tokens_per_s": batch * seq_len / sec, "wall_s": time.time() - t0,
               "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            trace = profile_dir / f"fp8_step_{name}.json"
            prof.export_chrome_trace(str(trace))
            row["gpu_time"] = gpu_time_breakdown(json.loads(trace.read_text()).get("traceEvents", []), top=30)
            trace.unlink()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "gpu_time"}), flush=True)
        if "gpu_time" in row:
            print(json.dumps(row["gpu_time"]["ms_per_step"]), flush=True)
        model = compiled = opt = None  # free before the next variant
        if cuda:
            torch.cuda.empty_cache()
    f8.fp8_linear.__kwdefaults__["fast_accum"] = True
    baseline = next((r for r in rows if r["variant"] == "bf16"), None)
    for r in rows:
        if baseline:
            r["vs_bf16"] = r["tokens_per_s"] / baseline["tokens_per_s"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--parts", default="linears,step,convergence,flce_chunks")
    p.add_argument("--conv-preset", default="gpt2-124m")
    p.add_argument("--conv-steps", type=int, default=400)
    p.add_argument("--conv-runs", default="bf16,fp8", help=f"comma list of {sorted(CONV_RUNS)}")
    p.add_argument("--step-preset", default="gpt-1.3b:2048:8")
    p.add_argument("--step-variants", default="bf16,fp8,fp8-exact-forward-accum,fp8-fused-qkv")
    p.add_argument("--linear-fast-accum", default="1", help="comma list of forward fast-accum settings: 1,0")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result = {"benchmark": "bench_fp8", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if args.smoke:
        M, shapes, iters = 64, [(64, 32)], 2
        conv = ("tiny", 64, 4, 6, 1e-3)
        flce_shape, chunks = (64, 32, 320), [16, 32]
        step = ("tiny", 64, 4, 2, 1)
    else:
        M, iters = 16384, 20
        shapes = [(2048, 2048), (2048, 6144), (2048, 8192), (8192, 2048)]
        conv = (args.conv_preset, 512, 32, args.conv_steps, 1e-3)
        flce_shape, chunks = (16384, 2048, 50304), [2048, 4096, 8192, 16384]
        preset, T, B = args.step_preset.split(":")
        step = (preset, int(T), int(B), 15, 5)
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from lightning_perf.kernels.ops import fp8_linear as f8

    def linears():
        rows = []
        for fast in args.linear_fast_accum.split(","):
            f8.fp8_linear.__kwdefaults__["fast_accum"] = fast == "1"
            rows += [dict(r, fast_accum_forward=fast == "1") for r in bench_linears(device, M, shapes, iters)]
        f8.fp8_linear.__kwdefaults__["fast_accum"] = True
        return rows

    for part, fn in (("linears", linears),
                     ("step", lambda: bench_step(device, step[0], step[1], step[2], args.step_variants.split(","),
                                                 step[3], step[4], out)),
                     ("convergence", lambda: bench_convergence(device, *conv, runs=args.conv_runs.split(","))),
                     ("flce_chunks", lambda: bench_flce_chunks(device, *flce_shape, chunks, iters))):
        if part not in parts:
            continue
        try:
            result[part] = fn()
        except Exception as err:
            result[part] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print(result[part]["traceback"], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    fname = out / f"bench_fp8_{stamp}{'_smoke' if args.smoke else ''}.json"
    fname.write_text(json.dumps(result, indent=2))
    print(f"wrote {fname}")


if __name__ == "__main__":
    main()
