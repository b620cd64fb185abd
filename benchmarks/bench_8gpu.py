"""Eight GPUs of one host (8x H200, NVLink switch): 3D layouts of llama-8b, weak scaling of gpt-1.3b.

    python benchmarks/bench_8gpu.py --out DIR                  # part "main", ~9 min on 8x H200
    python benchmarks/bench_8gpu.py --out DIR --part compile   # compiled llama-8b layouts, ~9 min
    python benchmarks/bench_8gpu.py --out DIR --part auto      # the default pipeline against 1F1B m=8
    python benchmarks/bench_8gpu.py --out DIR --part 4gpu --gpus 4   # llama-8b layouts on 4 GPUs, ~9 min
    python benchmarks/bench_8gpu.py --smoke                    # same code paths, tiny models, CPU/gloo
    python benchmarks/bench_8gpu.py --out DIR --part 4gpu --gpus 4 --global-batch-tokens 524288 --warmup 1 \
        --steps 2 --budget 450 --only 'gb_llama8b_dp4*,gb_llama8b_pp2*auto'   # at a large global batch, ~6 min

Every variant trains inside Lightning's ``Trainer.fit`` (bf16-mixed, AdamW, random tokens,
parameters built on meta and initialised on the GPUs) through the measuring code of
``bench_parallel3d.py``: tokens over the wall time of a window of steps after warm-up (the mean
step; median, p90 and slowest step beside it), one profiled step per variant. Every ratio below
comes from that headline; the same ratio from the CUDA-event median step, as the earlier results
report it, is kept under ``*_median_step``.

Part ``main``:

- llama-8b, T=4096, global batch 32 sequences (131k tokens) per step, eager, under
  ``Parallel3DStrategy``: dp8 with ZeRO-3 (selective activation checkpointing: matmul and
  attention outputs kept); pp2 x tp2 x dp2 (1F1B, 8 microbatches, ZeRO-1 on dp, no
  checkpointing); tp8 (sequence parallel, selective, 16 sequences); pp2 x dp4 (1F1B, 8 microbatches,
  ZeRO-2, no checkpointing).
- gpt-1.3b (untied head), T=2048, 8 sequences per GPU, ZeRO-2 eager: dp1 -> dp2 -> dp4 -> dp8
  weak scaling (efficiency = tokens/s per GPU against dp1), then dp8 ZeRO-3 and Lightning's
  own FSDPStrategy (FULL_SHARD, per-block wrap) on the same 8 GPUs.

Part ``compile``: the llama-8b dp8 and pp2 x tp2 x dp2 layouts with the strategy's
``compile="default"`` (Inductor per block; first steps compile inside the warm-up), dp8 ZeRO-2 with
FP8 linears whose weights are gathered in FP8 (the MFU then counts bf16 FLOPs against the bf16 peak), and
Lightning's FSDPStrategy on dp8 for llama-8b (selective is ours only: full checkpointing there).

Part ``auto``: llama-8b pp2 x dp4 and pp2 x tp2 x dp2 with the strategy's default pipeline
(``"auto"``: schedule, microbatches and stages per rank chosen from the batch and the model; the
row records the choice), beside the hand-set 1F1B with 8 microbatches in the same group.

Part ``4gpu`` (four GPUs): llama-8b at T=8192, 8 sequences per step (2 per GPU), FP8 tensorwise with
fused q / k / v, the pack's kernels, compiled blocks and selective checkpointing, as ZeRO-3 dp4 (weights
gathered in FP8), tp2 x dp2 (batch-sharded sequence parallelism, ZeRO-3 over dp; synchronous and async
TP) and pp2 x dp2 (the default pipeline, and interleaved 1F1B on 4 stages per rank; ZeRO-3 over dp):
each 3D layout against ZeRO-3 on the same GPUs.

With ``--global-batch-tokens [N]`` (default 262,144 tokens per GPU: 1,048,576 = 128 sequences of 8192), part
``4gpu`` runs its layouts at that global batch instead (:func:`global_batch_specs`, group ``llama8b_4gpu_gb``):
ZeRO-3 as ``ZeroStrategy(stage=3, accumulation="auto")`` accumulating 16 micro-batches of 2 sequences per GPU,
pp2 x dp2 with 64 microbatches of one sequence per replica (1F1B, and the default pipeline), tp2 x dp2
accumulating 16 micro-batches of 4 sequences; steps are optimizer steps, each row carries the step breakdown
(compute, exposed P2P, exposed collectives, idle) and the pipelines their bubble against theory and against
ZeRO-3. A step of the default batch takes about 20 s: run one or two layouts per call (``--only``) with
``--warmup 1 --steps 2``, or half the batch (``--global-batch-tokens 524288``, 64 sequences) for two.

Reported per variant: tokens/s in all and per GPU, MFU per GPU (causal attention counted once,
989 TFLOP/s dense bf16; ``mfu_attention_twice`` over the full square), peak allocated memory (max
over ranks), exposed communication % (NCCL kernel time under no compute kernel, over the
mean step; max over ranks), GPU compute-idle % (pipeline bubble + waits), and for pipelines the
bubble theory ``(p-1) / (m+p-1)``. Variants of one model and world share one spawned group;
a group past its deadline is killed and its unfinished variants recorded as failures; later
groups are skipped once ``--budget`` seconds are spent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_parallel3d as b3  # noqa: E402

LLAMA = {"preset": "llama-8b", "seq_len": 4096, "global_batch": 32}
# llama-8b at T=8192, 2 sequences per GPU on 4 GPUs, as the ZeRO-3 figures of bench_parallel.py: FP8 tensorwise,
# q / k / v from one matmul, the pack's kernels, attention "auto", compiled blocks, selective checkpointing
LLAMA_4GPU = {"preset": "llama-8b", "seq_len": 8192, "global_batch": 8, "fp8": True, "fused_qkv": True,
              "kernels": "triton", "attention": "auto", "compile": "default", "ac": "selective"}
GPT13 = {"preset": "gpt-1.3b", "seq_len": 2048}

# (part, group name, world, {variant: spec}); groups run in this order
GROUPS: list[tuple[str, str, int, dict[str, dict[str, Any]]]] = [
    ("main", "llama8b_8gpu", 8, {
        "llama8b_dp8_zero3": dict(LLAMA, zero=3, ac="selective"),
        "llama8b_pp2_tp2_dp2": dict(LLAMA, pp=2, tp=2, zero=1, schedule="1f1b", m=8),
        # 16 sequences: at 32 the vocabulary-parallel loss's fp32 logits (8 GB) do not fit beside the model
        "llama8b_tp8": dict(LLAMA, tp=8, ac="selective", global_batch=16, smoke_config={"n_head": 8, "n_kv_head": 8}),
        "llama8b_pp2_dp4": dict(LLAMA, pp=2, zero=2, schedule="1f1b", m=8),
    }),
    ("main", "gpt13b_dp1", 1, {"gpt13b_dp1": dict(GPT13, global_batch=8)}),
    ("main", "gpt13b_dp2", 2, {"gpt13b_dp2_zero2": dict(GPT13, global_batch=16, zero=2)}),
    ("main", "gpt13b_dp4", 4, {"gpt13b_dp4_zero2": dict(GPT13, global_batch=32, zero=2)}),
    ("main", "gpt13b_dp8", 8, {
        "gpt13b_dp8_zero2": dict(GPT13, global_batch=64, zero=2),
        "gpt13b_dp8_zero3": dict(GPT13, global_batch=64, zero=3),
        "gpt13b_dp8_lightning_fsdp": dict(GPT13, global_batch=64, strategy="lightning_fsdp"),
    }),
    ("compile", "llama8b_8gpu_compile", 8, {
        "llama8b_dp8_zero3_compile": dict(LLAMA, zero=3, ac="selective", compile="default"),
        # FP8 linears, weights gathered in FP8, ZeRO-2 (one gather per block per step)
        "llama8b_dp8_zero2_fp8_compile": dict(LLAMA, zero=2, ac="selective", compile="default", fp8=True,
                                              fp8_all_gather=True),
        "llama8b_pp2_tp2_dp2_compile": dict(LLAMA, pp=2, tp=2, zero=1, schedule="1f1b", m=8, compile="default"),
        "llama8b_dp8_lightning_fsdp": dict(LLAMA, strategy="lightning_fsdp", ac="full"),
    }),
    # the default pipeline ("auto": here interleaved 1F1B, 2 stages per rank, microbatches of 2 x 4096)
    ("auto", "llama8b_8gpu_auto", 8, {
        "llama8b_pp2_dp4": dict(LLAMA, pp=2, zero=2, schedule="1f1b", m=8),
        "llama8b_pp2_dp4_auto": dict(LLAMA, pp=2, zero=2, auto=True),
        "llama8b_pp2_tp2_dp2": dict(LLAMA, pp=2, tp=2, zero=1, schedule="1f1b", m=8),
        "llama8b_pp2_tp2_dp2_auto": dict(LLAMA, pp=2, tp=2, zero=1, auto=True),
    }),
    # the 3D layouts on four GPUs against ZeRO-3 over all four (weights gathered in FP8), same model and tokens
    ("4gpu", "llama8b_4gpu", 4, {
        "llama8b_dp4_zero3_fp8": dict(LLAMA_4GPU, zero=3, fp8_all_gather=True),
        "llama8b_tp2_dp2_fp8": dict(LLAMA_4GPU, tp=2, zero=3, sp="batch"),
        "llama8b_tp2_dp2_fp8_async": dict(LLAMA_4GPU, tp=2, zero=3, sp="batch", async_tp=True),
        "llama8b_pp2_dp2_fp8_auto": dict(LLAMA_4GPU, pp=2, zero=3, auto=True),
        # 4 stages of 4 blocks per rank: a bubble of 1/17 instead of auto's 1/9 at the same 4 microbatches
        "llama8b_pp2_dp2_fp8_spr4": dict(LLAMA_4GPU, pp=2, zero=3, schedule="interleaved_1f1b", m=4, spr=4),
    }),
    # Python's garbage collector on a fixed schedule on every rank (GarbageCollection every 10 steps):
    # how much of a layout's exposed communication comes from one rank's collector pauses
    ("gc", "gpt13b_dp8_gc", 8, {
        "gpt13b_dp8_zero2": dict(GPT13, global_batch=64, zero=2),
        "gpt13b_dp8_zero2_gc": dict(GPT13, global_batch=64, zero=2, gc=10),
    }),
    ("gc", "llama8b_8gpu_gc", 8, {
        "llama8b_pp2_dp4": dict(LLAMA, pp=2, zero=2, schedule="1f1b", m=8),
        "llama8b_pp2_dp4_gc": dict(LLAMA, pp=2, zero=2, schedule="1f1b", m=8, gc=10),
    }),
]



def global_batch_specs() -> dict[str, dict[str, Any]]:
    """The 4-GPU llama-8b layouts of part ``4gpu`` at one global batch in tokens (``--global-batch-tokens``):
    ZeRO-3 over the four GPUs (``ZeroStrategy(accumulation="auto")``, FP8 weight gathers) accumulating micro-batches
    of 2 sequences per GPU; pp2 x dp2 (ZeRO-3 over dp) cutting each replica's batch into microbatches of one
    sequence, by 1F1B and by the strategy's default; tp2 x dp2 accumulating 4 sequences per replica
    (``micro``: see ``bench_parallel3d.GLOBAL_BATCH_VARIANTS``)."""
    return {
        "gb_llama8b_dp4_zero3_fp8": dict(LLAMA_4GPU, strategy="zero", zero=3, fp8_all_gather=True, micro=2),
        "gb_llama8b_pp2_dp2_fp8_auto": dict(LLAMA_4GPU, pp=2, zero=3, auto=True),
        "gb_llama8b_pp2_dp2_fp8_1f1b": dict(LLAMA_4GPU, pp=2, zero=3, schedule="1f1b", micro=1),
        "gb_llama8b_tp2_dp2_fp8": dict(LLAMA_4GPU, tp=2, zero=3, sp="batch", micro=4),
    }


# a group's deadline: seconds per variant plus the group's start (spawn, imports, NCCL)
PER_VARIANT_S = {"llama8b_8gpu": 85.0, "llama8b_8gpu_compile": 150.0, "llama8b_8gpu_gc": 85.0,
                 "llama8b_8gpu_auto": 85.0, "llama8b_4gpu": 130.0, "llama8b_4gpu_gb": 240.0}
DEFAULT_PER_VARIANT_S = 35.0
GROUP_START_S = 30.0


def weak_scaling(results: list[dict]) -> dict[str, Any]:
    """Tokens/s per GPU of the ZeRO-2 gpt-1.3b runs against dp1 (same per-GPU batch); by wall clock and,
    under ``*_median_step``, from the median step."""
    ok = {r["variant"]: r for r in results if r.get("ok")}
    base = ok.get("gpt13b_dp1")
    table: dict[str, Any] = {}
    for name in ("gpt13b_dp1", "gpt13b_dp2_zero2", "gpt13b_dp4_zero2", "gpt13b_dp8_zero2"):
        r = ok.get(name)
        if r is None:
            continue
        row: dict[str, Any] = {"variant": name}
        for suffix in ("", "_median_step"):
            per_gpu = r[f"tokens_per_s{suffix}"] / r["world"]
            row[f"tokens_per_s{suffix}"] = r[f"tokens_per_s{suffix}"]
            row[f"tokens_per_s_per_gpu{suffix}"] = per_gpu
            row[f"efficiency{suffix}"] = per_gpu / (base[f"tokens_per_s{suffix}"] / base["world"]) if base else None
        table[str(r["world"])] = row
    return table


def add_figures(results: list[dict]) -> None:
    from lightning_perf.parallel.model_parallel.pipeline import bubble_fraction

    for r in results:
        if not r.get("ok"):
            continue
        r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / r["world"]
        r["tokens_per_s_per_gpu_median_step"] = r["tokens_per_s_median_step"] / r["world"]
        if r.get("pp", 1) > 1:
            r["bubble_theory"] = bubble_fraction(r["pp"], r["microbatches"], r.get("stages_per_rank", 1))
            shares = [b["exposed_p2p_pct"] + b["idle_pct"] for b in r.get("step_breakdown_per_rank") or [] if b]
            if shares:  # the largest share of the profiled step in which a rank computes nothing
                r["bubble_trace"] = max(shares) / 100.0
    fsdp = next((r for r in results if r.get("ok") and r["variant"] == "gpt13b_dp8_lightning_fsdp"), None)
    for r in results:
        if fsdp is not None and r.get("ok") and r["variant"].startswith("gpt13b_dp8"):
            r["vs_lightning_fsdp_dp8"] = r["tokens_per_s"] / fsdp["tokens_per_s"]
            r["vs_lightning_fsdp_dp8_median_step"] = r["tokens_per_s_median_step"] / fsdp["tokens_per_s_median_step"]
    for group, baseline in (("llama8b_4gpu", "llama8b_dp4_zero3_fp8"), ("llama8b_4gpu_gb", "gb_llama8b_dp4_zero3_fp8")):
        zero3_4 = next((r for r in results if r.get("ok") and r["variant"] == baseline), None)
        for r in results:  # the 4-GPU 3D layouts against ZeRO-3 on the same four GPUs (and batch)
            if zero3_4 is not None and r.get("ok") and r.get("group") == group:
                r["vs_zero3_dp4"] = r["tokens_per_s"] / zero3_4["tokens_per_s"]
                r["vs_zero3_dp4_median_step"] = r["tokens_per_s_median_step"] / zero3_4["tokens_per_s_median_step"]
                if r.get("pp", 1) > 1:  # same tokens per step: the step-time ratio
                    r["bubble_measured"] = 1.0 - r["vs_zero3_dp4"]
    lfsdp8b = next((r for r in results if r.get("ok") and r["variant"] == "llama8b_dp8_lightning_fsdp"), None)
    for r in results:
        if lfsdp8b is not None and r.get("ok") and r["variant"].startswith("llama8b"):
            r["vs_lightning_fsdp_llama8b"] = r["tokens_per_s"] / lfsdp8b["tokens_per_s"]
            r["vs_lightning_fsdp_llama8b_median_step"] = (r["tokens_per_s_median_step"]
                                                          / lfsdp8b["tokens_per_s_median_step"])


def plot(report: dict, path: Path) -> None:
    """Two panels: gpt-1.3b tokens/s per GPU from dp1 to dp8 (with Lightning FSDP at dp8) and
    llama-8b tokens/s per GPU and MFU per layout on 8 GPUs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {r["variant"]: r for r in report["results"] if r.get("ok")}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ws = report.get("weak_scaling", {})
    if ws:
        gpus = [int(k) for k in ws]
        per = [v["tokens_per_s_per_gpu"] / 1e3 for v in ws.values()]
        a.plot(gpus, per, "o-", label="ours, ZeRO-2 (eager)")
        if per:
            a.axhline(per[0] * 0.95, color="grey", ls=":", label="95% of dp1")
        for name, marker, label in (("gpt13b_dp8_zero3", "s", "ours, ZeRO-3 (eager)"),
                                    ("gpt13b_dp8_lightning_fsdp", "x", "Lightning FSDPStrategy")):
            if name in ok:
                a.plot([ok[name]["world"]], [ok[name]["tokens_per_s_per_gpu"] / 1e3], marker, ms=9, label=label)
        a.set_xscale("log", base=2)
        a.set_xticks(gpus, [str(g) for g in gpus])
        a.set_ylim(0, max(per) * 1.25 if per else 1)
        a.set_xlabel("GPUs (data parallel, 8 x 2048 tokens per GPU)")
        a.set_ylabel("thousand tokens/s per GPU")
        a.set_title("gpt-1.3b weak scaling, H200")
        a.legend(loc="lower right", fontsize=8)
    llama = [r for r in report["results"] if r["variant"].startswith("llama8b")]
    names = [r["variant"].replace("llama8b_", "") for r in llama]
    vals = [r.get("tokens_per_s_per_gpu", 0) / 1e3 if r.get("ok") else 0 for r in llama]
    bars = b.bar(range(len(llama)), vals, color=["C0" if r.get("ok") else "lightgrey" for r in llama])
    for bar, r in zip(bars, llama):
        text = f"{100 * r['mfu']:.1f}% MFU" if r.get("ok") else "failed"
        b.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.1, text, ha="center", fontsize=8)
    b.axhline(9.6, color="grey", ls=":", label="target 9.6k")
    b.set_xticks(range(len(llama)), names, rotation=20, fontsize=8)
    b.set_ylabel("thousand tokens/s per GPU")
    b.set_title("llama-8b, T=4096, 8 x H200")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--part", choices=("main", "compile", "gc", "auto", "4gpu", "all"), default="main")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU processes (gloo)")
    parser.add_argument("--gpus", type=int, default=8, help="largest world; groups needing more are skipped")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds; a group that cannot finish is skipped")
    parser.add_argument("--only", default=None, help="comma-separated variant patterns (default: the part's all)")
    parser.add_argument("--global-batch-tokens", nargs="?", type=int, const=0, default=None, metavar="N",
                        help="part 4gpu only: its layouts at N tokens per optimizer step (no N: "
                             f"{b3.GLOBAL_TOKENS_PER_GPU} per GPU; --smoke: {b3.SMOKE_GLOBAL_TOKENS})")
    parser.add_argument("--plot-from", nargs="+", default=None,
                        help="only draw the scaling plot from saved JSON results (merged) into --out")
    a = parser.parse_args(argv)
    if a.plot_from:
        merged: dict[str, Any] = {"results": [], "weak_scaling": {}}
        for f in a.plot_from:
            rep = json.loads(Path(f).read_text())
            merged["results"] += rep["results"]
            merged["weak_scaling"].update(rep.get("weak_scaling", {}))
        target = Path(a.out) / "bench_8gpu_scaling.png"
        plot(merged, target)
        print(f"wrote {target}")
        return 0
    if a.smoke:
        a.warmup, a.steps = 1, 1
    args = {"smoke": a.smoke, "preset": "gpt-1.3b", "seq_len": 32 if a.smoke else 2048, "global_batch": 16,
            "warmup": a.warmup, "steps": a.steps, "compile_backend": "aot_eager" if a.smoke else "inductor"}
    groups = GROUPS
    if a.global_batch_tokens is not None:
        if a.part != "4gpu":
            parser.error("--global-batch-tokens runs the layouts of --part 4gpu at a global batch: add --part 4gpu")
        tokens = a.global_batch_tokens or (b3.SMOKE_GLOBAL_TOKENS if a.smoke else b3.GLOBAL_TOKENS_PER_GPU * 4)
        specs = {k: dict(v, global_tokens=tokens) for k, v in global_batch_specs().items()}
        for name in b3.select(list(specs), a.only):  # the numbers checked before any process starts
            try:
                b3.global_batch_layout(specs[name], 4, tokens, args["seq_len"] if a.smoke else specs[name]["seq_len"],
                                       a.smoke)
            except ValueError as e:
                parser.error(f"{name}: {e}")
        groups = [("4gpu", "llama8b_4gpu_gb", 4, specs)]
        args["global_batch_tokens"] = tokens
    start = time.perf_counter()
    results: list[dict] = []
    for part, group, world, specs in groups:
        if a.part != "all" and part != a.part:
            continue
        names = b3.select(list(specs), a.only)
        if not names:
            continue
        if world > a.gpus:
            results += [{"variant": n, "ok": False, "error": f"skipped: needs {world} GPUs"} for n in names]
            continue
        per = PER_VARIANT_S.get(group, DEFAULT_PER_VARIANT_S) * (3 if a.smoke else 1)
        timeout = GROUP_START_S + per * len(names)
        left = a.budget - (time.perf_counter() - start)
        if left < GROUP_START_S + per:
            results += [{"variant": n, "ok": False, "error": f"skipped: {left:.0f}s of the budget left"} for n in names]
            print(f"[{group}] skipped (budget)", flush=True)
            continue
        t0 = time.perf_counter()
        merged = b3.run_group(names, specs, args, world, min(timeout, left))
        for r in merged:
            r["group"] = group
            status = (f"{r['tokens_per_s']:.0f} tok/s, {r['tokens_per_s'] / world:.0f}/GPU, MFU {100 * r['mfu']:.1f}%"
                      if r.get("ok") else f"FAILED {r.get('error', '')[:300]}")
            print(f"[{r['variant']}] {status}", flush=True)
        print(f"[{group}] {time.perf_counter() - t0:.0f}s", flush=True)
        results += merged
    add_figures(results)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = {
        "benchmark": "bench_8gpu",
        "part": a.part,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else a.gpus,
        "torch": torch.__version__,
        "triton": triton_version,
        "config": {**args, "groups": [(p, g, w, s) for p, g, w, s in groups], "peak_flops": b3.PEAK_BF16},
        "headline": "tokens / wall-clock seconds over the timed window (mean step), rank 0's clock",
        "wall_s": time.perf_counter() - start,
        "weak_scaling": weak_scaling(results),
        "results": results,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"bench_8gpu{'_smoke' if a.smoke else ''}_{a.part}_{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    try:
        plot(report, path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001  (no matplotlib: the JSON is the result)
        print(f"no plot: {e}")
    print(f"\n{'variant':30s} {'tok/s':>9s} {'/GPU':>7s} {'MFU':>6s} {'memGB':>6s} {'exp.comm':>8s} {'idle':>6s} "
          f"{'bubble th.':>10s}")
    for r in results:
        if not r.get("ok"):
            print(f"{r['variant']:30s} failed: {r.get('error', '')[:90]}")
            continue

        def pct(key: str) -> str:
            return f"{r[key]:.1f}%" if r.get(key) is not None else "-"

        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        bub = f"{100 * r['bubble_theory']:.0f}%" if r.get("bubble_theory") is not None else "-"
        print(f"{r['variant']:30s} {r['tokens_per_s']:9.0f} {r['tokens_per_s_per_gpu']:7.0f} {100 * r['mfu']:5.1f}% "
              f"{mem:>6s} {pct('exposed_comm_pct'):>8s} {pct('compute_idle_pct'):>6s} {bub:>10s}")
    b3.print_step_breakdown(results)
    ws = report["weak_scaling"]
    if ws:
        print("weak scaling (gpt-1.3b ZeRO-2, tokens/s per GPU vs dp1): " + ", ".join(
            f"dp{k} {v['efficiency']:.3f}" if v["efficiency"] is not None else f"dp{k} -" for k, v in ws.items()))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
