"""The GPT-2 MLP of gpt-1.3b with delayed FP8: GELU and its casts fused (``fp8_gelu_mlp``) against the
two delayed layers around a separate GELU, and the bf16 MLP, all compiled (GPU only).

    python benchmarks/bench_fp8_mlp.py --out DIR
    python benchmarks/bench_fp8_mlp.py --smoke     # CPU, tiny shapes, not compiled: the code paths only

Per variant: forward + backward of one MLP at the recipe's shape (tokens = 8 x 2048, d = 2048,
F = 8192; input in fp32 as the LayerNorm under bf16 autocast hands it over), timed with CUDA events
in interleaved rounds after warm-up (the histories filled), the GPU time per call and the bytes
the fused form saves; and each variant's output and gradients against the fp32 MLP of the same
weights (relative error). JSON to --out.
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
from lightning_perf.models.gpt.config import GPTConfig  # noqa: E402
from lightning_perf.models.gpt.model import MLP  # noqa: E402


def build(cfg: GPTConfig, fused: bool, state: dict, device: str) -> torch.nn.Module:
    mlp = MLP(cfg).to(device)
    mlp.load_state_dict(state, strict=False)
    mlp.delayed_fp8 = fused and cfg.fp8 == "delayed"
    return mlp


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--tokens", type=int, default=8 * 2048)
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    dev = "cpu" if a.smoke else "cuda"
    if a.smoke:
        a.preset, a.tokens, a.rounds, a.iters = "tiny", 64, 2, 2
    torch.manual_seed(0)
    base = GPTConfig.from_name(a.preset, kernels="triton")
    ref = MLP(base).to(dev)
    torch.nn.init.normal_(ref.up_proj.weight, std=0.02)
    torch.nn.init.normal_(ref.down_proj.weight, std=0.02 / (2 * base.n_layer) ** 0.5)
    torch.nn.init.normal_(ref.up_proj.bias, std=0.02)
    state = ref.state_dict()
    fp8 = GPTConfig.from_name(a.preset, kernels="triton", fp8="delayed")
    variants = {"fp8-fused": build(fp8, True, state, dev), "fp8-layers": build(fp8, False, state, dev),
                "bf16": build(base, False, state, dev)}
    M, d = a.tokens, base.n_embd
    x = torch.randn(M, d, device=dev)  # LayerNorm output: fp32 under autocast
    g = torch.randn(M, d, device=dev, dtype=torch.bfloat16)

    def step_fn(mlp):
        compiled = mlp if a.smoke else torch.compile(mlp)

        def step(inp):
            with torch.autocast(dev, dtype=torch.bfloat16):
                y = compiled(inp)
            y.backward(g)
            return y
        return step

    steps = {k: step_fn(m) for k, m in variants.items()}
    rows: dict = {k: {"ms": []} for k in variants}
    for name, step in steps.items():  # compile, fill the histories
        for _ in range(5):
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
    # accuracy against the fp32 MLP of the same weights
    xr = x.detach().requires_grad_()
    yr = ref(xr)
    yr.backward(g.float())
    want = [yr.detach(), xr.grad, ref.up_proj.weight.grad, ref.up_proj.bias.grad, ref.down_proj.weight.grad]
    for name, mlp in variants.items():
        mlp.zero_grad()
        inp = x.detach().requires_grad_()
        y = steps[name](inp)
        got = [y.detach(), inp.grad, mlp.up_proj.weight.grad, mlp.up_proj.bias.grad, mlp.down_proj.weight.grad]
        rows[name]["rel_err"] = {k: float((gt.float() - w.float()).norm() / w.float().norm())
                                 for k, gt, w in zip(("y", "dx", "dW_up", "db_up", "dW_down"), got, want)}
        rows[name]["median_ms"] = statistics.median(rows[name]["ms"])
    saved = 2 * 4 * M * fp8.intermediate_size  # per call: h and dL/du, each written + read once in bf16
    result = {"benchmark": "bench_fp8_mlp", "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "preset": a.preset, "tokens": M,
              "d": d, "F": fp8.intermediate_size, "rounds": a.rounds, "iters": a.iters,
              "bytes_saved_per_call": saved, "rows": rows,
              "fused_vs_layers": rows["fp8-layers"]["median_ms"] / rows["fp8-fused"]["median_ms"],
              "fused_vs_bf16": rows["bf16"]["median_ms"] / rows["fp8-fused"]["median_ms"],
              "layers_vs_bf16": rows["bf16"]["median_ms"] / rows["fp8-layers"]["median_ms"]}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}
                     | {k: (round(r["median_ms"], 3), r["rel_err"]) for k, r in rows.items()}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_fp8_mlp_{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
