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
   so the curves can be compared point by point. With several ``--conv-seeds`` (is FP8 within 1% of
   bf16 over seeds?) each (run, seed) trains in a process of its own, all at once on the one GPU
   (``--conv-procs``; the runs are small and host-bound, so sharing the GPU changes their wall times,
   which this part does not report, and no loss); merged per run: the mean loss over the last 10% of
   steps for each seed, its mean against bf16's (``rel_diff_vs_bf16``, ``within_1pct``), and bf16's
   own spread over the seeds (a difference inside it is not one the seeds can tell apart); the curves
   averaged over the seeds (SVG). ``--conv-deadline`` stops processes still running; each process gets
   an equal share of the host's cores as its intra-op threads (``OMP_NUM_THREADS``, unless set).
4. ``numerics``: one linear's output and both gradients, eager and compiled, for each FP8 path against
   an fp32 ``F.linear`` of the same operands (relative error), and the pack's tensorwise matmul against
   torchao's directly: a gap between the two tensorwise paths shows here before it shows in a curve.
5. ``flce_chunks``: ``fused_linear_cross_entropy`` forward + backward at gpt-1.3b's head
   (16384 x 2048, vocabulary 50304) for several chunk sizes against torch.compile of the reference:
   the time each chunking costs and its extra memory.
6. ``mlp``: the GPT-2 MLP of ``--mlp-preset`` with delayed FP8, GELU and its casts fused
   (``fp8_gelu_mlp``: one kernel each way) against the two delayed layers around a separate GELU,
   and the bf16 MLP; forward + backward of one MLP compiled (tokens 8 x 2048; the input in fp32 as
   the LayerNorm hands it over under bf16 autocast), timed with CUDA events in interleaved rounds
   after warm-up (the histories filled); each variant's output and gradients against the fp32 MLP
   of the same weights (relative error).

    python benchmarks/bench_fp8.py --out $OUT
    python benchmarks/bench_fp8.py --parts convergence --conv-runs bf16,tensorwise,delayed --out $OUT
    python benchmarks/bench_fp8.py --parts convergence --conv-runs bf16,delayed --conv-seeds 0,1,2   # over seeds
    python benchmarks/bench_fp8.py --parts mlp --out $OUT                                        # fused GELU MLP
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
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


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


def summarise_seeds(per_seed: dict[str, dict[int, dict]]) -> dict:
    """Per run: each seed's last-10% mean and validation loss, their means, and the relative difference of
    the mean against bf16's over the seeds both finished; bf16's spread over its seeds."""
    out: dict = {}
    for run, seeds in per_seed.items():
        tails = {s: last_10pct_mean(r["losses"]) for s, r in seeds.items()}
        out[run] = {"seeds": sorted(seeds), "last_10pct_mean_by_seed": tails,
                    "val_loss_by_seed": {s: r.get("val_loss") for s, r in seeds.items()},
                    "last_10pct_mean": statistics.fmean(tails.values()) if tails else None,
                    "last_10pct_spread": (max(tails.values()) - min(tails.values())) if tails else None,
                    "wall_s_by_seed": {s: r.get("wall_s") for s, r in seeds.items()}}
    ref = out.get("bf16")
    if ref:
        for run, row in out.items():
            common = sorted(set(row["seeds"]) & set(ref["seeds"]))
            if run == "bf16" or not common:
                continue
            got = statistics.fmean(row["last_10pct_mean_by_seed"][s] for s in common)
            base = statistics.fmean(ref["last_10pct_mean_by_seed"][s] for s in common)
            row["seeds_compared"] = common
            row["rel_diff_vs_bf16"] = (got - base) / base
            row["rel_diff_vs_bf16_by_seed"] = {
                s: (row["last_10pct_mean_by_seed"][s] - ref["last_10pct_mean_by_seed"][s])
                / ref["last_10pct_mean_by_seed"][s] for s in common}
            row["within_1pct"] = abs(row["rel_diff_vs_bf16"]) <= 0.01
        ref["rel_spread_over_seeds"] = (ref["last_10pct_spread"] / ref["last_10pct_mean"]
                                        if ref["last_10pct_mean"] else None)
    return out


def mean_curves(per_seed: dict[str, dict[int, dict]]) -> dict[str, list[float]]:
    """Each run's loss per step averaged over the seeds it finished."""
    curves = {}
    for run, seeds in per_seed.items():
        rows = [r["losses"] for r in seeds.values()]
        if rows:
            n = min(len(r) for r in rows)
            curves[f"{run} ({len(rows)} seeds)"] = [statistics.fmean(r[i] for r in rows) for i in range(n)]
    return curves


def bench_convergence_seeds(runs: list[str], seeds: list[int], child_args: list[str], work: Path, procs: int,
                            deadline: float) -> dict:
    """The convergence part once per (run, seed), each in a child process of this script (``procs`` at a
    time, all by default), merged: :func:`summarise_seeds` and each run's losses per seed."""
    jobs = [(run, seed) for seed in seeds for run in runs]
    procs = procs or len(jobs)
    env = dict(os.environ)  # the host's cores shared out: more intra-op threads than cores stall every child
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
    start = time.time()
    pending, active, logs = list(jobs), {}, {}
    while pending or active:
        while pending and len(active) < procs:
            run, seed = pending.pop(0)
            dest = work / f"{run}-{seed}"
            dest.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--parts", "convergence", "--conv-runs", run,
                   "--conv-seeds", str(seed), "--out", str(dest), *child_args]
            logs[(run, seed)] = open(dest / "log.txt", "w")  # noqa: SIM115 (closed when the process ends)
            active[(run, seed)] = subprocess.Popen(cmd, stdout=logs[(run, seed)], stderr=subprocess.STDOUT, env=env)
        for key, proc in list(active.items()):
            if proc.poll() is not None:
                logs[key].close()
                del active[key]
                print(f"convergence {key} finished rc={proc.returncode} at {time.time() - start:.0f} s", flush=True)
        if time.time() - start > deadline:
            for key, proc in active.items():
                proc.kill()
                proc.wait()
                logs[key].close()
                print(f"convergence {key} stopped at the deadline", flush=True)
            active.clear()
            break
        time.sleep(1.0)
    per_seed: dict[str, dict[int, dict]] = {r: {} for r in runs}
    failed, meta = {}, {}
    for run, seed in jobs:
        found = sorted((work / f"{run}-{seed}").glob("bench_fp8_*.json"))
        conv = json.loads(found[-1].read_text()).get("convergence", {}) if found else {}
        if isinstance(conv.get(run), dict) and "losses" in conv[run]:
            per_seed[run][seed] = conv[run]
            meta = {k: conv[k] for k in ("preset", "seq_len", "batch", "steps", "lr", "train_windows") if k in conv}
        else:
            log = work / f"{run}-{seed}" / "log.txt"
            failed[f"{run}-{seed}"] = log.read_text()[-1500:] if log.exists() else "not started"
    return {**meta, "runs": runs, "seeds": seeds, "concurrent_processes": procs, "wall_s": time.time() - start,
            "summary": summarise_seeds(per_seed), "failed": failed,
            "losses": {run: {str(s): r["losses"] for s, r in by_seed.items()} for run, by_seed in per_seed.items()},
            "_curves": mean_curves(per_seed)}


def bench_mlp(device, preset: str, tokens: int, rounds: int, iters: int) -> dict:
    """The GELU MLP with delayed FP8, fused and as two layers, and in bf16 (module docstring, part 6)."""
    from _timing import StepTimer
    from lightning_perf.models.gpt.config import GPTConfig
    from lightning_perf.models.gpt.model import MLP

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    base = GPTConfig.from_name(preset, kernels="triton")
    ref = MLP(base).to(device)
    torch.nn.init.normal_(ref.up_proj.weight, std=0.02)
    torch.nn.init.normal_(ref.down_proj.weight, std=0.02 / (2 * base.n_layer) ** 0.5)
    torch.nn.init.normal_(ref.up_proj.bias, std=0.02)
    state = ref.state_dict()
    fp8 = GPTConfig.from_name(preset, kernels="triton", fp8="delayed")

    def build(cfg, fused: bool):
        mlp = MLP(cfg).to(device)
        mlp.load_state_dict(state, strict=False)
        mlp.delayed_fp8 = fused and cfg.fp8 == "delayed"
        return mlp

    variants = {"fp8-fused": build(fp8, True), "fp8-layers": build(fp8, False), "bf16": build(base, False)}
    M, d = tokens, base.n_embd
    x = torch.randn(M, d, device=device)  # the LayerNorm's output: fp32 under autocast
    g = torch.randn(M, d, device=device, dtype=torch.bfloat16)

    def step_fn(mlp):
        run = torch.compile(mlp) if cuda else mlp

        def step(inp):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = run(inp)
            y.backward(g)
            return y
        return step

    steps = {k: step_fn(m) for k, m in variants.items()}
    rows: dict = {k: {"ms": []} for k in variants}
    for step in steps.values():  # compile, fill the histories
        for _ in range(5):
            step(x.detach().requires_grad_())
    for _ in range(rounds):
        for name, step in steps.items():
            inp = x.detach().requires_grad_()
            timer = StepTimer(cuda)
            timer.mark()
            for _ in range(iters):
                step(inp)
            timer.mark()
            rows[name]["ms"].append(1e3 * timer.step_times()[0] / iters)
    xr = x.detach().requires_grad_()
    yr = ref(xr)
    yr.backward(g.float())
    want = [yr.detach(), xr.grad, ref.up_proj.weight.grad, ref.up_proj.bias.grad, ref.down_proj.weight.grad]
    for name, mlp in variants.items():
        mlp.zero_grad()
        inp = x.detach().requires_grad_()
        y = steps[name](inp)
        got = [y.detach(), inp.grad, mlp.up_proj.weight.grad, mlp.up_proj.bias.grad, mlp.down_proj.weight.grad]
        rows[name]["rel_err"] = {k: float((a.float() - b.float()).norm() / b.float().norm())
                                 for k, a, b in zip(("y", "dx", "dW_up", "db_up", "dW_down"), got, want)}
        rows[name]["median_ms"] = statistics.median(rows[name]["ms"])
    result = {"preset": preset, "tokens": M, "d": d, "F": fp8.intermediate_size, "rounds": rounds, "iters": iters,
              "compiled": cuda,
              "bytes_saved_per_call": 2 * 4 * M * fp8.intermediate_size,  # h and dL/du, each written + read in bf16
              "rows": rows,
              "fused_vs_layers": rows["fp8-layers"]["median_ms"] / rows["fp8-fused"]["median_ms"],
              "fused_vs_bf16": rows["bf16"]["median_ms"] / rows["fp8-fused"]["median_ms"],
              "layers_vs_bf16": rows["bf16"]["median_ms"] / rows["fp8-layers"]["median_ms"]}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {k: (round(r["median_ms"], 3), r["rel_err"]) for k, r in rows.items()}), flush=True)
    return result


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


PARTS = ("linears", "step", "numerics", "convergence", "flce_chunks", "mlp")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--parts", default="linears,step,convergence,flce_chunks,mlp", help=f"comma list of {PARTS}")
    p.add_argument("--conv-preset", default="gpt2-124m")
    p.add_argument("--conv-steps", type=int, default=2000)
    p.add_argument("--conv-batch", type=int, default=8, help="sequences of 512 bytes per step")
    p.add_argument("--conv-seeds", default="0",
                   help="model initialisation seeds, comma list; several: one process per (run, seed), merged")
    p.add_argument("--conv-procs", type=int, default=0, help="with several seeds: processes at once (0: all)")
    p.add_argument("--conv-deadline", type=float, default=540.0,
                   help="with several seeds: seconds; processes still running then are stopped")
    p.add_argument("--conv-runs", default="bf16,tensorwise,rowwise", help=f"comma list of {sorted(CONV_RUNS)}")
    p.add_argument("--step-preset", default="gpt-1.3b:2048:8")
    p.add_argument("--step-variants", default="bf16,tensorwise-fused-qkv,torchao-tensorwise-fused-qkv,rowwise-fused-qkv",
                   help=f"comma list of {sorted(STEP_VARIANTS)}")
    p.add_argument("--step-steps", type=int, default=15)
    p.add_argument("--linear-variants", default=",".join(LINEAR_VARIANTS))
    p.add_argument("--mlp-preset", default="gpt-1.3b")
    p.add_argument("--mlp-tokens", type=int, default=8 * 2048)
    p.add_argument("--mlp-rounds", type=int, default=7)
    p.add_argument("--mlp-iters", type=int, default=20)
    p.add_argument("--tag", default="", help="suffix of the result's name")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    conv_runs = [r for r in args.conv_runs.split(",") if r]
    seeds = [int(s) for s in args.conv_seeds.split(",") if s]
    unknown = sorted(set(parts) - set(PARTS)) + sorted(set(conv_runs) - set(CONV_RUNS))
    if unknown or not seeds:
        p.error(f"unknown parts or runs {unknown} (parts: {PARTS}; runs: {sorted(CONV_RUNS)}), or no seed")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result = {"benchmark": "bench_fp8", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if args.smoke:
        M, shapes, iters = 64, [(64, 32)], 2
        conv = ("tiny", 64, 4, 30, 1e-3)
        flce_shape, chunks = (64, 32, 320), [16, 32]
        step = ("tiny", 64, 4, 2, 1)
        mlp = ("tiny", 64, 2, 2)
    else:
        M, iters = 16384, 20
        shapes = [(2048, 2048), (2048, 6144), (2048, 8192), (8192, 2048)]
        conv = (args.conv_preset, 512, args.conv_batch, args.conv_steps, 1e-3)
        flce_shape, chunks = (16384, 2048, 50304), [2048, 4096, 8192, 16384]
        preset, T, B = args.step_preset.split(":")
        step = (preset, int(T), int(B), args.step_steps, 5)
        mlp = (args.mlp_preset, args.mlp_tokens, args.mlp_rounds, args.mlp_iters)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    fname = out / f"bench_fp8_{stamp}{args.tag}{'_smoke' if args.smoke else ''}.json"

    def save() -> None:  # after every part and every step variant: a run cut short keeps what it measured
        fname.write_text(json.dumps(result, indent=2))

    def linears():
        return bench_linears(device, M, shapes, iters, args.linear_variants.split(","))

    def partial_step(rows):
        result["step"] = list(rows)
        save()

    def curves(conv_result) -> None:
        svg = out / f"{fname.stem}_curves.svg"
        if "_curves" in conv_result:  # several seeds: each run's curve averaged over them
            runs, title = conv_result.pop("_curves"), "mean over seeds"
        else:
            runs = {k: v["losses"] for k, v in conv_result.items() if isinstance(v, dict) and "losses" in v}
            title = "same seed"
        if runs:
            svg.write_text(curves_svg(runs, f"{result['device']}: {conv[0]}, loss per step, {title}"))

    def convergence():
        if len(seeds) == 1:
            return bench_convergence(device, *conv, runs=conv_runs, on_run=partial_convergence, seed=seeds[0])
        child = ["--conv-preset", args.conv_preset, "--conv-steps", str(args.conv_steps),
                 "--conv-batch", str(args.conv_batch)] + (["--smoke"] if args.smoke else [])
        with tempfile.TemporaryDirectory(prefix="bench_fp8_seeds_") as work:
            return bench_convergence_seeds(conv_runs, seeds, child, Path(work), args.conv_procs, args.conv_deadline)

    def partial_convergence(conv_result) -> None:
        result["convergence"] = dict(conv_result)
        curves(conv_result)
        save()

    for part, fn in (("linears", linears),
                     ("step", lambda: bench_step(device, step[0], step[1], step[2], args.step_variants.split(","),
                                                 step[3], step[4], out, partial_step)),
                     ("numerics", lambda: bench_numerics(device, M, shapes + ([] if args.smoke else [(768, 2304), (3072, 768)]))),
                     ("convergence", convergence),
                     ("flce_chunks", lambda: bench_flce_chunks(device, *flce_shape, chunks, iters)),
                     ("mlp", lambda: bench_mlp(device, *mlp))):
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
