"""Where the host's time goes in an FP8 training step (one GPU).

    python benchmarks/profile_host.py --out DIR [--preset gpt2-124m --seq-len 1024 --batch 16]

A small model's FP8 step can be host-bound: the host needs as long to issue the step as the GPU
needs to run it, since FP8 adds casts and scale computations per linear. For bf16 and fp8 (same
plain loop, bf16 autocast, fused AdamW, whole-model torch.compile) this records:

- the host time to issue one step (no synchronisation inside: with the GPU behind, it is the
  issue cost) against the GPU step time;
- one profiled step's host operators by self CPU time (the top 30);
- microbenchmarks of the FP8 pieces called eagerly on gpt2-124m-sized operands: host microseconds
  per call of ``cast_transpose_fp8`` (the op's dispatch and its Triton launch), of the kernel's
  direct launch alone, of ``torch._scaled_mm`` and of ``fp8_linear`` forward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def host_us(fn, n: int = 300) -> float:
    """Host microseconds per call, the GPU kept busy so the calls only queue."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    big = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):  # ~ tens of ms of queued GPU work: the calls below never wait for the GPU
        big @ big
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * dt / n


def micro() -> dict:
    from lightning_perf.kernels.ops import fp8_casts as f8
    from lightning_perf.kernels.ops import fp8_linear as f8_linear

    x = torch.randn(16384, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16)
    scale = f8._scale_of(x, f8.E4M3)
    q, qt = f8.cast_transpose_fp8(x, scale, f8.E4M3)
    wq, winv = f8.quantize_fp8(w, f8.E4M3)
    out = {
        "cast_transpose_fp8 (custom op)": host_us(lambda: f8.cast_transpose_fp8(x, scale, f8.E4M3)),
        "cast_transpose launch only": host_us(lambda: f8._cast_transpose_launch(x, scale, f8.E4M3)),
        "scale_of (amax)": host_us(lambda: f8._scale_of(x, f8.E4M3)),
        "quantize_fp8 (weight)": host_us(lambda: f8.quantize_fp8(w, f8.E4M3)),
        "_scaled_mm": host_us(lambda: torch._scaled_mm(q, wq.t(), scale_a=scale.reciprocal(), scale_b=winv,
                                                       out_dtype=torch.bfloat16, use_fast_accum=True)),
        "bf16 matmul": host_us(lambda: x @ w.t()),
    }
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    out["fp8_linear forward (eager)"] = host_us(lambda: f8_linear.fp8_linear(xr, wr))
    out["F.linear forward (eager)"] = host_us(lambda: torch.nn.functional.linear(xr, wr))
    return out


def step_profile(preset: str, T: int, B: int, fp8: bool, warmup: int, steps: int) -> dict:
    from lightning_perf.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig.from_name(preset, block_size=T, fp8=fp8)
    model = GPT(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cmodel = torch.compile(model)
    x = torch.randint(0, config.vocab_size, (B, T), device="cuda")
    y = torch.randint(0, config.vocab_size, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cmodel(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b) / 1e3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:30]:
        rows.append({"name": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "cpu_total_ms": e.cpu_time_total / 1e3})
    model.cpu()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return {"fp8": fp8, "host_step_ms_median": 1e3 * statistics.median(host),
            "gpu_step_ms_median": 1e3 * statistics.median(gpu), "top_host_ops": rows}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "preset": a.preset, "seq_len": a.seq_len, "batch": a.batch}
    report["micro_host_us"] = micro()
    print(json.dumps(report["micro_host_us"], indent=1), flush=True)
    report["steps"] = []
    for fp8 in (False, True):
        r = step_profile(a.preset, a.seq_len, a.batch, fp8, a.warmup, a.steps)
        report["steps"].append(r)
        print(f"fp8={fp8}: host {r['host_step_ms_median']:.1f} ms, GPU {r['gpu_step_ms_median']:.1f} ms", flush=True)
        for row in r["top_host_ops"][:15]:
            print(f"   {row['self_cpu_ms']:8.2f} ms {row['calls']:6d}x  {row['name'][:90]}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"profile_host_{stamp}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
