"""FP8 linears (``GPTConfig(fp8=...)``, torchao.float8) against bf16, same run, one GPU; plus the LM-head
loss chunking.

Parts, all written to one JSON:
1. ``linears``: one linear's forward + backward at the gpt-1.3b shapes (16384 tokens), compiled,
   the tensorwise (the pack's matmul and torchao's), delayed and rowwise FP8 linears against
   ``F.linear`` under bf16 autocast.
2. ``step``: a plain training loop (bf16 autocast, whole-model compile, fused AdamW) per model variant
   (``--step-variants``); tokens / wall time over the timed steps, peak memory, one profiled step.
3. ``convergence``: the same model trained from the same seed on the built-in corpus (real text, bytes)
   in bf16 and with FP8 linears (``--conv-runs``: tensorwise, delayed, rowwise, ...); loss every step,
   so the curves can be compared point by point.
4. ``numerics``: one linear's output and both gradients, eager and compiled, for each FP8 path against
   an fp32 ``F.linear`` of the same operands (relative error), and the pack's tensorwise matmul against
   torchao's directly: a gap between the two tensorwise paths shows here before it shows in a curve.
5. ``flce_chunks``: ``fused_linear_cross_entropy`` forward + backward at gpt-1.3b's head
   (16384 x 2048, vocabulary 50304) for several chunk sizes against torch.compile of the reference:
   the time each chunking costs and its extra memory.

    python benchmarks/bench_fp8.py --out $OUT
    python benchmarks/bench_fp8.py --parts convergence --conv-runs bf16,tensorwise,delayed --out $OUT
    python benchmarks/bench_fp8.py --smoke          # CPU, tiny shapes, checks the code paths
"""

from __future__ import annotations

import argparse
import contextlib
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
    """Seconds per call: wall time over ``iters`` calls after ``warmup``, the device drained at both ends."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _fp8_linear(recipe: str, K: int, N: int, device) -> torch.nn.Module:
    from lightning_perf.kernels.torchao_fp8 import convert_to_fp8

    holder = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=device))
    convert_to_fp8(holder, "tensorwise" if recipe == "torchao-tensorwise" else recipe)  # "delayed": a history too
    return holder[0]


@contextlib.contextmanager
def _torchao_matmuls(on: bool):
    """With ``on``, tensorwise layers run torchao's matmul for plain weights too (not ``kernels.ops.fp8_linear``)."""
    from lightning_perf.kernels import torchao_fp8 as float8

    original = float8._pack_path
    if on:
        float8._pack_path = lambda x, weight: False
    try:
        yield
    finally:
        float8._pack_path = original


LINEAR_VARIANTS = ("bf16", "tensorwise", "torchao-tensorwise", "delayed", "rowwise")


def bench_linears(device, M: int, shapes, iters: int, variants=LINEAR_VARIANTS) -> list[dict]:
    cuda = device.type == "cuda"
    rows = []
    for K, N in shapes:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16 if cuda else torch.float32, requires_grad=True)
        g = torch.randn(M, N, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
        row = {"M": M, "K": K, "N": N, "flop_fwd_bwd": 6 * M * K * N}
        for name in variants:
            torch.manual_seed(0)
            layer = torch.nn.Linear(K, N, bias=False, device=device) if name == "bf16" else \
                _fp8_linear(name, K, N, device)
            step_fn = torch.compile(layer) if cuda else layer
            torchao_only = name == "torchao-tensorwise"

            def step():
                with _torchao_matmuls(torchao_only), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    y = step_fn(x)
                    y.backward(g)
                x.grad = layer.weight.grad = None

            try:
                t = _time(step, iters, 3, cuda)
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_tflops"] = row["flop_fwd_bwd"] / t / 1e12
            except Exception as err:
                row[f"{name}_error"] = f"{type(err).__name__}: {err}"
        for name in variants:
            if name != "bf16" and "bf16_ms" in row and f"{name}_ms" in row:
                row[f"{name}_speedup"] = row["bf16_ms"] / row[f"{name}_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_numerics(device, M: int, shapes, variants=("tensorwise", "torchao-tensorwise", "rowwise")) -> list[dict]:
    cuda = device.type == "cuda"
    rows = []

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

    for K, N in shapes:
        gen = torch.Generator(device=device).manual_seed(K * 7 + N)
        # activations with a few large channels and gradients spanning several decades, as in training
        x = torch.randn(M, K, device=device, generator=gen)
        x[:, :4] *= 20
        g = torch.randn(M, N, device=device, generator=gen) * torch.rand(M, 1, device=device, generator=gen).pow(4)
        dtype = torch.bfloat16 if cuda else torch.float32
        for compiled in (False, True) if cuda else (False,):
            row = {"M": M, "K": K, "N": N, "compiled": compiled}
            outs = {}
            for name in variants:
                torch.manual_seed(0)
                layer = _fp8_linear(name, K, N, device)
                w = layer.weight.detach()
                fn = torch.compile(layer) if compiled else layer
                xi = x.to(dtype).clone().requires_grad_(True)
                with _torchao_matmuls(name == "torchao-tensorwise"), torch.autocast(device.type, dtype=torch.bfloat16,
                                                                                      enabled=cuda):
                    y = fn(xi)
                    y.backward(g.to(y.dtype))
                outs[name] = (y.detach(), xi.grad.detach(), layer.weight.grad.detach())
                xr = xi.detach().float().requires_grad_(True)
                wr = w.float().requires_grad_(True)
                yr = F.linear(xr, wr)
                yr.backward(g.to(y.dtype).float())
                for part, got, ref in zip(("y", "dx", "dw"), outs[name], (yr, xr.grad, wr.grad)):
                    row[f"{name}_{part}_rel_err"] = rel(got, ref)
            if "tensorwise" in outs and "torchao-tensorwise" in outs:
                for i, part in enumerate(("y", "dx", "dw")):
                    row[f"pack_vs_torchao_{part}_rel_diff"] = rel(outs["tensorwise"][i], outs["torchao-tensorwise"][i])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# name: (GPTConfig.fp8, tensorwise layers on torchao's matmul throughout)
CONV_RUNS = {"bf16": (False, False), "tensorwise": ("tensorwise", False), "rowwise": ("rowwise", False),
             "torchao-tensorwise": ("tensorwise", True), "delayed": ("delayed", False)}


def curves_svg(curves: dict[str, list[float]], title: str, window: int = 20, width: int = 720,
               height: int = 360) -> str:
    """Loss curves (a running mean over ``window`` steps) as a standalone SVG: no plotting library needed."""
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    smooth = {}
    for name, ys in curves.items():
        acc, out = 0.0, []
        for i, y in enumerate(ys):
            acc += y - (ys[i - window] if i >= window else 0.0)
            out.append(acc / min(i + 1, window))
        smooth[name] = out
    every = [y for ys in smooth.values() for y in ys[window:]] or [y for ys in smooth.values() for y in ys]
    lo, hi = min(every), max(every)
    hi = hi if hi > lo else lo + 1.0
    n = max(len(ys) for ys in smooth.values())
    left, right, top, bottom = 60, 20, 30, 40
    sx = (width - left - right) / max(1, n - 1)
    sy = (height - top - bottom) / (hi - lo)

    def point(i: int, y: float) -> str:
        return f"{left + i * sx:.1f},{top + (hi - min(max(y, lo), hi)) * sy:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="18">{title} (running mean of {window} steps)</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>']
    for frac in (0.0, 0.5, 1.0):
        y = lo + frac * (hi - lo)
        parts.append(f'<text x="4" y="{top + (hi - y) * sy + 4:.1f}">{y:.3f}</text>')
    parts.append(f'<text x="{width - right - 60}" y="{height - 10}">step {n}</text>')
    for c, (name, ys) in enumerate(smooth.items()):
        colour = colours[c % len(colours)]
        pts = " ".join(point(i, y) for i, y in enumerate(ys))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{width - right - 150}" y="{top + 16 * (c + 1)}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def last_10pct_mean(losses: list[float]) -> float:
    """The convergence criterion's statistic: the mean loss over the last 10% of steps."""
    return statistics.fmean(losses[-max(1, len(losses) // 10):])


def bench_convergence(device, preset: str, seq_len: int, batch: int, steps: int, lr: float,
                      runs=("bf16", "tensorwise"), on_run=None, seed: int = 0) -> dict:
    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPT, GPTConfig

    cuda = device.type == "cuda"
    # the whole stdlib (not the default 4 MB cap) at a small batch: 2,000 steps stay under about one
    # pass over the text, so the curves compare learning rather than memorising
    dm = TokenDataModule(source="builtin", seq_len=seq_len, batch_size=batch, num_workers=0,
                         builtin_max_bytes=1 << 30)
    dm.setup("fit")
    out = {"preset": preset, "seq_len": seq_len, "batch": batch, "steps": steps, "lr": lr,
           "train_windows": len(dm.train_dataset), "train_windows_seen": steps * batch, "seed": seed}
    for key in runs:
        fp8, torchao_only = CONV_RUNS[key]
        patch = _torchao_matmuls(torchao_only)
        patch.__enter__()
        torch._dynamo.reset()
        torch.manual_seed(seed)
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
        patch.__exit__(None, None, None)
        model = compiled = opt = None  # free before the next variant
        if on_run is not None:
            on_run(out)
    for key in runs:  # the 1% criterion: mean loss over the last 10% of steps, against bf16's
        if key != "bf16" and "bf16" in out and key in out:
            ref, got = last_10pct_mean(out["bf16"]["losses"]), last_10pct_mean(out[key]["losses"])
            out[f"last_10pct_rel_diff_{key}_vs_bf16"] = (got - ref) / ref
    for a, b in (("bf16", "tensorwise"), ("bf16", "rowwise"), ("bf16", "torchao-tensorwise"), ("bf16", "delayed"),
                 ("tensorwise", "delayed")):
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


STEP_VARIANTS = {
    # name: (GPTConfig overrides, tensorwise layers on torchao's matmul throughout)
    "bf16": ({}, False),
    "bf16-fused-qkv": ({"fused_qkv": True}, False),
    "tensorwise": ({"fp8": "tensorwise"}, False),
    "torchao-tensorwise": ({"fp8": "tensorwise"}, True),
    "torchao-tensorwise-fused-qkv": ({"fp8": "tensorwise", "fused_qkv": True}, True),
    "tensorwise-fused-qkv": ({"fp8": "tensorwise", "fused_qkv": True}, False),
    "rowwise": ({"fp8": "rowwise"}, False),
    "rowwise-fused-qkv": ({"fp8": "rowwise", "fused_qkv": True}, False),
    "delayed": ({"fp8": "delayed"}, False),
    "delayed-fused-qkv": ({"fp8": "delayed", "fused_qkv": True}, False),
}


def bench_step(device, preset: str, seq_len: int, batch: int, variants, steps: int, warmup: int,
               profile_dir: Path, on_row=None) -> list[dict]:
    """A plain loop (bf16 autocast, whole-model compile, fused AdamW) per variant; one profiled step each."""
    from lightning_perf.models import GPT, GPTConfig
    from lightning_perf.perf.gpu_time import gpu_time_breakdown

    cuda = device.type == "cuda"
    rows = []
    for name in variants:
        overrides, torchao_only = STEP_VARIANTS[name]
        patch = _torchao_matmuls(torchao_only)
        patch.__enter__()
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(preset, block_size=seq_len, **overrides)
        with torch.device(device):
            model = GPT(cfg)
        compiled = torch.compile(model) if cuda else model
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
        row = {"variant": name, "config": overrides, "step_ms_wall_mean": sec * 1e3, "steps": steps,
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
        if on_row is not None:
            on_row(rows)
        print(json.dumps({k: v for k, v in row.items() if k != "gpu_time"}), flush=True)
        if "gpu_time" in row:
            print(json.dumps(row["gpu_time"]["ms_per_step"]), flush=True)
        patch.__exit__(None, None, None)
        model = compiled = opt = None  # free before the next variant
        if cuda:
            torch.cuda.empty_cache()
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
    p.add_argument("--conv-steps", type=int, default=2000)
    p.add_argument("--conv-batch", type=int, default=8, help="sequences of 512 bytes per step")
    p.add_argument("--conv-seed", type=int, default=0, help="model initialisation seed of every convergence run")
    p.add_argument("--conv-runs", default="bf16,tensorwise,rowwise", help=f"comma list of {sorted(CONV_RUNS)}")
    p.add_argument("--step-preset", default="gpt-1.3b:2048:8")
    p.add_argument("--step-variants", default="bf16,tensorwise-fused-qkv,torchao-tensorwise-fused-qkv,rowwise-fused-qkv",
                   help=f"comma list of {sorted(STEP_VARIANTS)}")
    p.add_argument("--step-steps", type=int, default=15)
    p.add_argument("--linear-variants", default=",".join(LINEAR_VARIANTS))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result = {"benchmark": "bench_fp8", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if args.smoke:
        M, shapes, iters = 64, [(64, 32)], 2
        conv = ("tiny", 64, 4, 30, 1e-3)
        flce_shape, chunks = (64, 32, 320), [16, 32]
        step = ("tiny", 64, 4, 2, 1)
    else:
        M, iters = 16384, 20
        shapes = [(2048, 2048), (2048, 6144), (2048, 8192), (8192, 2048)]
        conv = (args.conv_preset, 512, args.conv_batch, args.conv_steps, 1e-3)
        flce_shape, chunks = (16384, 2048, 50304), [2048, 4096, 8192, 16384]
        preset, T, B = args.step_preset.split(":")
        step = (preset, int(T), int(B), args.step_steps, 5)
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    fname = out / f"bench_fp8_{stamp}{'_smoke' if args.smoke else ''}.json"

    def save() -> None:  # after every part and every step variant: a run cut short keeps what it measured
        fname.write_text(json.dumps(result, indent=2))

    def linears():
        return bench_linears(device, M, shapes, iters, args.linear_variants.split(","))

    def partial_step(rows):
        result["step"] = list(rows)
        save()

    def curves(conv_result) -> None:
        runs = {k: v["losses"] for k, v in conv_result.items() if isinstance(v, dict) and "losses" in v}
        svg = out / f"bench_fp8_{stamp}{'_smoke' if args.smoke else ''}_curves.svg"
        svg.write_text(curves_svg(runs, f"{result['device']}: {conv[0]}, loss per step, same seed"))

    def partial_convergence(conv_result) -> None:
        result["convergence"] = dict(conv_result)
        curves(conv_result)
        save()

    for part, fn in (("linears", linears),
                     ("step", lambda: bench_step(device, step[0], step[1], step[2], args.step_variants.split(","),
                                                 step[3], step[4], out, partial_step)),
                     ("numerics", lambda: bench_numerics(device, M, shapes + ([] if args.smoke else [(768, 2304), (3072, 768)]))),
                     ("convergence", lambda: bench_convergence(device, *conv, runs=args.conv_runs.split(","),
                                                               on_run=partial_convergence, seed=args.conv_seed)),
                     ("flce_chunks", lambda: bench_flce_chunks(device, *flce_shape, chunks, iters))):
        if part not in parts:
            continue
        try:
            result[part] = fn()
            if part == "convergence":
                curves(result[part])
        except Exception as err:
            result[part] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print(result[part]["traceback"], flush=True)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(f"wrote {fname}")


if __name__ == "__main__":
    main()
