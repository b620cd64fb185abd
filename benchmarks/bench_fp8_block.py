"""One gpt-1.3b block with delayed FP8, compiled, with its norm outputs cast inside the norm's kernel
(``kernels.float8.delayed_norm_input``: the default) against the same block whose linears cast the fp32
norm outputs themselves (the cast-transpose kernel), GPU only.

    python benchmarks/bench_fp8_block.py --out DIR
    python benchmarks/bench_fp8_block.py --smoke     # CPU, tiny shapes, not compiled: the code paths only

Per variant: forward + backward of one ``Block`` at the recipe's shape (8 x 2048 tokens, d = 2048; the
residual stream in fp32, as bf16 autocast leaves it), timed with CUDA events in interleaved rounds
after warm-up (histories filled); the kernels of one profiled call (name, calls, GPU ms); and the
variants' outputs and gradients against each other (relative difference). JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import StepTimer  # noqa: E402
from lightning_perf.kernels import float8  # noqa: E402
from lightning_perf.models.gpt.config import GPTConfig  # noqa: E402
from lightning_perf.models.gpt.model import Block  # noqa: E402

MODES = {"norm-cast": "compile", "cast-kernel": "never"}


def kernels_of(step, inp, dev: str) -> list[dict]:
    """GPU kernels of one call: name, calls, total ms (largest first)."""
    if dev != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(inp)
        torch.cuda.synchronize()
    rows = [{"name": e.key[:110], "calls": e.count, "ms": round(e.device_time_total / 1e3, 4)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:25]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    dev = "cpu" if a.smoke else "cuda"
    if a.smoke:
        a.preset, a.batch, a.seq, a.rounds, a.iters = "tiny", 2, 32, 2, 2
    cfg = GPTConfig.from_name(a.preset, kernels="triton", attention="sdpa", fp8="delayed", fused_qkv=True)
    torch.manual_seed(0)
    blocks = {}
    for name in MODES:
        torch.manual_seed(0)
        blocks[name] = Block(cfg).to(dev)
        for m in blocks[name].modules():
            if hasattr(m, "reset_parameters") and m is not blocks[name]:
                m.reset_parameters()
    state = blocks["norm-cast"].state_dict()
    blocks["cast-kernel"].load_state_dict(state)
    B, T, d = a.batch, a.seq, cfg.n_embd
    x = torch.randn(B, T, d, device=dev)  # the residual stream: fp32 under bf16 autocast
    g = torch.randn(B, T, d, device=dev)

    def step_fn(name):
        block = blocks[name]
        compiled = block if a.smoke else torch.compile(block)

        def step(inp):
            float8.NORM_CAST_IN_GRAPH = "always" if (a.smoke and name == "norm-cast") else MODES[name]
            with torch.autocast(dev, dtype=torch.bfloat16):
                y = compiled(inp)
            y.backward(g)
            return y
        return step

    steps = {k: step_fn(k) for k in MODES}
    rows: dict = {k: {"ms": []} for k in MODES}
    for name, step in steps.items():  # compile, fill the histories
        for _ in range(4):
            step(x.detach().requires_grad_())
    for _ in range(a.rounds):
        for name, step in steps.items():
            inp = x.detach().requires_grad_()
            timer = StepTimer(dev == "cuda")
            timer.mark()
            for _ in range(a.iters):
                step(inp)
            timer.mark()
            rows[name]["ms"].append(1e3 * timer.step_times()[0] / a.iters)
    outs = {}
    for name, step in steps.items():
        blocks[name].zero_grad()
        inp = x.detach().requires_grad_()
        y = step(inp)
        outs[name] = {"y": y.detach(), "dx": inp.grad} | {n: p.grad for n, p in blocks[name].named_parameters()}
        rows[name]["median_ms"] = statistics.median(rows[name]["ms"])
        rows[name]["kernels"] = kernels_of(step, x.detach().requires_grad_(), dev)
    diffs = {k: float((u.float() - v.float()).norm() / v.float().norm().clamp(min=1e-30))
             for (k, u), v in zip(outs["norm-cast"].items(), outs["cast-kernel"].values())
             if u is not None and v is not None}
    saved = 2 * 7 * B * T * d  # per call: two norm outputs, fp32 write + read replaced by an FP8 write + read
    result = {"benchmark": "bench_fp8_block", "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
              "torch": torch.__version__, "date": datetime.date.today().isoformat(), "preset": a.preset,
              "tokens": B * T, "d": d, "rounds": a.rounds, "iters": a.iters, "bytes_saved_per_call": saved,
              "rows": rows,
              "norm_cast_vs_cast_kernel": rows["cast-kernel"]["median_ms"] / rows["norm-cast"]["median_ms"],
              "rel_diff": diffs}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {k: round(r["median_ms"], 3) for k, r in rows.items()}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_fp8_block_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
