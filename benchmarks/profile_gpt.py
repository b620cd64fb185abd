"""Which of the pack's kernels helps or hurts the whole GPT step: one op at a time, same run.

A plain loop (bf16 autocast, fused AdamW, per-block or whole-model torch.compile) over one preset,
with ``kernels="triton"`` but every op except the named ones routed to the reference path; then
one torch.profiler step of the all-Triton model, the top GPU kernels printed and saved.

    python benchmarks/profile_gpt.py --out $OUT --preset gpt2-124m --seq-len 1024 --batch 16
    python benchmarks/profile_gpt.py --preset gpt-1.3b --seq-len 2048 --batch 8 --scope model \
        --fused-qkv --sets all,all+fp8 --profile all,all+fp8         # where FP8 saves time, and where not
    python benchmarks/profile_gpt.py --preset gpt-1.3b --seq-len 2048 --batch 8 --scope model \
        --fused-qkv --sets all+fp8,all+delayed --profile all+fp8,all+delayed   # tensorwise against delayed scaling
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import StepTimer  # noqa: E402

OPS = ("attention", "norm", "mlp_activation", "lm_loss")


ELEMENTWISE_UNDER_COMPILE = "inductor"  # --elementwise-under-compile


def only(enabled: set[str]):
    """Patch the default dispatcher so only ``enabled`` ops use Triton (others return None = reference)."""
    from lightning_perf.kernels import dispatch

    d = dispatch.KernelDispatcher(elementwise_under_compile=ELEMENTWISE_UNDER_COMPILE)
    for op in OPS:
        if op not in enabled:
            setattr(d, op, lambda *a, **k: None)
    dispatch.set_default_dispatcher(d)


def kernel_breakdown(trace_path: Path, steps: int) -> dict:
    from lightning_perf.perf.gpu_time import gpu_time_breakdown

    return gpu_time_breakdown(json.loads(trace_path.read_text()).get("traceEvents", []), steps=steps)


def run(preset, seq_len, batch, steps, warmup, scope, attention, enabled, profile_dir=None, fp8=False,
        fused_qkv=False, label=""):
    from lightning_perf.models import GPT, GPTConfig
    from lightning_perf.parallel.compile import apply_compile

    only(enabled)
    torch._dynamo.reset()
    kernels = "triton" if enabled else "torch"
    cfg = GPTConfig.from_name(preset, kernels=kernels, attention=attention if "attention" in enabled else "sdpa",
                              fp8=fp8, fused_qkv=fused_qkv)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
    apply_compile(list(model.blocks.values()) if scope == "block" else [model], "default")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device="cuda")
    y = torch.randint(0, cfg.vocab_size, (batch, seq_len), device="cuda")
    timer = StepTimer(True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup + steps):
        timer.mark()
        step()
    timer.mark()
    times = timer.step_times(skip=warmup)
    table = None
    breakdown = None
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        trace = Path(profile_dir) / f"trace_{label or '_'.join(sorted(enabled)) or 'torch'}.json"
        prof.export_chrome_trace(str(trace))
        breakdown = kernel_breakdown(trace, steps=2)
        print(json.dumps(breakdown, indent=1), flush=True)
    step = None  # drop the model and optimizer before the next run
    torch.cuda.empty_cache()
    return statistics.median(times) * 1e3, min(times) * 1e3, max(times) * 1e3, table, breakdown


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--scope", default="block")
    p.add_argument("--attention", default="auto")
    p.add_argument("--profile", default="all", help="comma list of op sets to profile: torch, all")
    p.add_argument("--sets", default="torch,all,each",
                   help="comma list of op sets to time: torch, all, each; a set with a '+fp8' suffix "
                        "(e.g. all+fp8) runs with tensorwise FP8 linears, '+delayed' with delayed-scaling ones, to "
                        "compare with and without in one run")
    p.add_argument("--tag", default="", help="suffix of the output JSON name")
    p.add_argument("--fp8", nargs="?", const="tensorwise", default=False, choices=("tensorwise", "rowwise", "delayed"),
                   help="FP8 linears in the blocks for every set (GPTConfig(fp8=...); bare --fp8: tensorwise)")
    p.add_argument("--fused-qkv", action="store_true", help="q/k/v from one linear (GPTConfig(fused_qkv=True))")
    p.add_argument("--elementwise-under-compile", default="inductor", choices=("inductor", "triton"),
                   help="inside compiled regions, norms / activations to Inductor or to the pack's kernels")
    args = p.parse_args()
    global ELEMENTWISE_UNDER_COMPILE
    ELEMENTWISE_UNDER_COMPILE = args.elementwise_under_compile
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    sets = []  # (label, enabled ops, fp8)
    for chosen in args.sets.split(","):
        base, _, suffix = chosen.partition("+")
        if suffix not in ("", "fp8", "delayed"):
            p.error(f"unknown set suffix in {chosen!r}: '+fp8' or '+delayed'")
        fp8 = {"fp8": "tensorwise", "delayed": "delayed"}.get(suffix, args.fp8)
        if base == "torch":
            sets.append((chosen, set(), fp8))
        elif base == "all":
            sets.append((chosen, set(OPS), fp8))
        elif base == "each":
            sets += [(op + (f"+{suffix}" if suffix else ""), {op}, fp8) for op in OPS]
        else:
            p.error(f"unknown set {chosen!r}")
    rows = []
    profiled = args.profile.split(",")
    for label, enabled, fp8 in sets:
        name = "+".join(sorted(enabled)) or "torch"
        if fp8:
            name += f"+fp8-{fp8}"
        prof = label in profiled
        try:
            med, lo, hi, table, breakdown = run(args.preset, args.seq_len, args.batch, args.steps, args.warmup, args.scope,
                                     args.attention, enabled, out if prof else None, fp8, args.fused_qkv,
                                     label.replace("+", "_"))
        except Exception as err:  # keep the other rows
            print(f"{name}: FAILED {type(err).__name__}: {err}", flush=True)
            rows.append({"ops": name, "error": repr(err)})
            save(out, args, rows)
            continue
        rows.append({"ops": name, "fp8": fp8, "step_ms_median": med, "step_ms_min": lo, "step_ms_max": hi})
        if breakdown:
            rows[-1]["breakdown"] = breakdown
        print(f"{name:45s} median {med:8.2f} ms  min {lo:8.2f}  max {hi:8.2f}", flush=True)
        if table:
            print(table, flush=True)
            (out / f"profile_gpt_{label.replace('+', '_')}.txt").write_text(table)
        save(out, args, rows)
    save(out, args, rows)


def save(out: Path, args, rows: list) -> None:
    """The JSON so far (after every row: a run cut short keeps what it measured)."""
    base = rows[0].get("step_ms_median") if rows else None
    for r in rows:
        if base and "step_ms_median" in r:
            r["speedup_vs_first"] = base / r["step_ms_median"]
    (out / f"profile_gpt{args.tag}.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": rows},
        indent=1))


if __name__ == "__main__":
    main()
