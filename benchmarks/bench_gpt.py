"""The GPT through the Lightning Trainer against a plain PyTorch loop over the same model, same run.

Both sides: bf16 autocast, per-block torch.compile, fused AdamW, synthetic tokens from the same
DataLoader, the same GPT module. Optional variants ablate the pack's Triton kernels and CUDA graphs.

Both sides are timed over a window of ``--steps`` steps after ``--warmup``, by the same rules: a
device synchronisation before the first timed step and after the last, the host clock between;
the Trainer side by ``_timing.WallClockWindow`` (its loop, logging and callbacks inside the
window), the plain loop by ``_timing.Window`` (data loading inside the window). Headline:
``tokens_per_s``, tokens over the window's wall time (the mean step, slow steps included), and
``ratio_vs_plain`` and MFU from it; beside it ``step_ms_mean`` / ``_median`` / ``_p90`` /
``_max`` (per-step CUDA events, read once at the end), the garbage collections and Dynamo
recompilations inside the window, and the median step's figures as the earlier results report
them (``tokens_per_s_median_step``, ``ratio_vs_plain_median_step``, ``mfu_causal_989_median_step``).
The JSON is rewritten after every variant.

    python benchmarks/bench_gpt.py --out $OUT                      # both models, default variants
    python benchmarks/bench_gpt.py --out $OUT --models gpt2-124m:1024:16 --steps 60 --warmup 20
    python benchmarks/bench_gpt.py --smoke                         # CPU, tiny, checks the code paths
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _baselines import plain_training_loop  # noqa: E402
from _timing import WallClockWindow, clear_graph_breaks, graph_breaks  # noqa: E402

from lightning_perf.kernels.ops import fp8_linear as _f8  # noqa: E402

_ABSMAX = _f8.absmax  # the library's amax; the "torch" ablation swaps it for the PyTorch reduction

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 datasheet


def measure_matmul_ceiling(device: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times)


def make_data(cfg, seq_len: int, batch: int, steps: int, device: torch.device):
    from lightning_perf.data import TokenDataModule

    dm = TokenDataModule(
        source="synthetic",
        vocab_size=cfg.vocab_size,
        seq_len=seq_len,
        batch_size=batch,
        num_workers=2 if device.type == "cuda" else 0,
        synthetic_train_samples=batch * (steps + 2),
        synthetic_val_samples=batch,
    )
    return dm


def run_plain(name, seq_len, batch, steps, warmup, device, kernels, compile_mode, scope="block", extra=None):
    from lightning_perf.models import GPT, GPTConfig
    from lightning_perf.parallel.compile import apply_compile

    cfg = GPTConfig.from_name(name, kernels=kernels, attention="auto" if kernels == "triton" else "sdpa",
                              **(extra or {}))
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    apply_compile(list(model.blocks.values()) if scope == "block" else [model], compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dm = make_data(cfg, seq_len, batch, warmup + steps, device)
    dm.setup("fit")
    window = plain_training_loop(model, opt, iter(dm.train_dataloader()), steps=steps, warmup=warmup, device=device,
                                 tokens_per_step=batch * seq_len, amp=device.type == "cuda")
    return window, cfg


def run_trainer(name, seq_len, batch, steps, warmup, device, kernels, compile_mode, scope="block", extra=None):
    import lightning as L

    from lightning_perf.models import GPTConfig, GPTLightningModule

    cfg = GPTConfig.from_name(name, kernels=kernels, attention="auto" if kernels == "triton" else "sdpa",
                              **(extra or {}))
    window = WallClockWindow(warmup=warmup, steps=steps, checkpoint=False)
    torch.manual_seed(0)
    module = GPTLightningModule(cfg, learning_rate=1e-4, warmup_steps=0, compile=compile_mode, compile_scope=scope)
    dm = make_data(cfg, seq_len, batch, warmup + steps, device)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[window],
    )
    trainer.fit(module, dm)
    return window.result, cfg


def summarise(window, cfg, seq_len, batch, ceiling):
    """The window's figures (tokens over its wall time, the headline) with MFU from them; the median
    step's tokens/s and MFU beside them under ``*_median_step``."""
    tok_s = window["tokens_per_s"]
    tok_s_median = batch * seq_len / (window["step_ms_median"] / 1e3)
    fpt = cfg.flops_per_token(seq_len)
    run_peak = max(window["peak_mem_gb"] or 0.0, window["peak_mem_gb_before_window"] or 0.0)
    return {
        **window,
        "tokens_per_s_median_step": tok_s_median,
        "mfu_causal_989": fpt * tok_s / PEAK_BF16,
        "mfu_causal_989_median_step": fpt * tok_s_median / PEAK_BF16,
        "mfu_full_attention_989": cfg.flops_per_token_full_attention(seq_len) * tok_s / PEAK_BF16,
        "mfu_vs_measured_ceiling": (fpt * tok_s / ceiling) if ceiling else None,
        # the whole run's peak (warm-up and compilation included), as the earlier results report it
        "peak_mem_gb": run_peak if window["peak_mem_gb"] is not None else None,
        "peak_mem_gb_window": window["peak_mem_gb"],
    }


VARIANTS = {
    # name: (runner, kernels, compile mode[, compile scope])
    "plain-compile": (run_plain, "torch", "default"),
    "trainer-compile": (run_trainer, "torch", "default"),
    "trainer-eager": (run_trainer, "torch", None),
    "trainer-triton-compile": (run_trainer, "triton", "default"),
    "trainer-triton-eager": (run_trainer, "triton", None),
    "plain-triton-compile": (run_plain, "triton", "default"),
    "plain-compile-model": (run_plain, "torch", "default", "model"),
    "trainer-compile-model": (run_trainer, "torch", "default", "model"),
    "plain-triton-compile-model": (run_plain, "triton", "default", "model"),
    "trainer-triton-compile-model": (run_trainer, "triton", "default", "model"),
    "plain-cudagraphs-model": (run_plain, "torch", "reduce-overhead", "model"),
    "trainer-triton-cudagraphs-model": (run_trainer, "triton", "reduce-overhead", "model"),
    # Inductor's matmul autotuning on both sides (the baseline gets the same mode)
    "plain-max-autotune-model": (run_plain, "torch", "max-autotune-no-cudagraphs", "model"),
    "trainer-triton-max-autotune-model": (run_trainer, "triton", "max-autotune-no-cudagraphs", "model"),
    "trainer-cudagraphs-model": (run_trainer, "torch", "reduce-overhead", "model"),
    # FP8 linears in the blocks (GPTConfig(fp8=True)); the bf16 baselines above are the comparison
    "plain-fp8-compile-model": (run_plain, "torch", "default", "model", {"fp8": True}),
    "trainer-triton-fp8-compile-model": (run_trainer, "triton", "default", "model", {"fp8": True}),
    "trainer-triton-fp8-compile": (run_trainer, "triton", "default", "block", {"fp8": True}),
    "trainer-fp8-compile-model": (run_trainer, "torch", "default", "model", {"fp8": True}),
    # ... with q/k/v as one linear: one amax and one cast of the block input instead of three
    "trainer-triton-fp8-qkv-compile-model": (run_trainer, "triton", "default", "model",
                                             {"fp8": True, "fused_qkv": True}),
    # ... with delayed scaling (scales from each operand's amax history; what gpt-1.3b-fp8 ships)
    "trainer-triton-fp8-delayed-qkv-compile-model": (run_trainer, "triton", "default", "model",
                                                     {"fp8": "delayed", "fused_qkv": True}),
    # ablation: the amax before each cast as the PyTorch reduction (Inductor fuses it into producers)
    # instead of the pack's streaming Triton kernel
    "trainer-triton-fp8-qkv-torch-amax-compile-model": (run_trainer, "triton", "default", "model",
                                                        {"fp8": True, "fused_qkv": True, "amax": "torch"}),
    # CUDA graphs: no host launch cost per kernel (the FP8 casts add many small launches at d=768)
    "plain-fp8-cudagraphs-model": (run_plain, "torch", "reduce-overhead", "model", {"fp8": True}),
    "trainer-triton-fp8-cudagraphs-model": (run_trainer, "triton", "reduce-overhead", "model", {"fp8": True}),
    "trainer-triton-fp8-qkv-cudagraphs-model": (run_trainer, "triton", "reduce-overhead", "model",
                                                {"fp8": True, "fused_qkv": True}),
    "trainer-triton-qkv-cudagraphs-model": (run_trainer, "triton", "reduce-overhead", "model", {"fused_qkv": True}),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--models", default="gpt2-124m:1024:16,gpt-1.3b:2048:8")
    p.add_argument("--variants", default="plain-compile,trainer-compile,trainer-triton-compile")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, eager, to check the code paths")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    variants = dict(VARIANTS)
    if args.smoke:
        args.models, args.steps, args.warmup = "tiny:64:4", 3, 1
        variants = {k: (v[0], "torch", None) + tuple(v[3:]) for k, v in VARIANTS.items()}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    ceiling = measure_matmul_ceiling(device) if device.type == "cuda" else None
    import triton

    result = {
        "benchmark": "bench_gpt",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "matmul_ceiling_tflops": ceiling / 1e12 if ceiling else None,
        "peak_bf16_tflops": PEAK_BF16 / 1e12,
        "headline": "tokens / wall-clock seconds over the timed window (mean step)",
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fname = out / f"bench_gpt{args.tag}{'_smoke' if args.smoke else ''}.json"
    for spec in args.models.split(","):
        name, T, B = spec.split(":")
        T, B = int(T), int(B)
        for variant in args.variants.split(","):
            runner, kernels, compile_mode, *rest = variants[variant]
            scope = rest[0] if rest else "block"
            extra = rest[1] if len(rest) > 1 else {}
            entry = {"model": name, "seq_len": T, "batch": B, "variant": variant, "kernels": kernels,
                     "compile": compile_mode, "compile_scope": scope, "config": extra}
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            extra = dict(extra)
            amax = extra.pop("amax", "triton")
            _f8.absmax = _ABSMAX if amax == "triton" else (lambda t: t.abs().amax().float())
            clear_graph_breaks()  # Dynamo's tally, per variant
            try:
                window, cfg = runner(name, T, B, args.steps, args.warmup, device, kernels, compile_mode, scope,
                                     extra)
                entry.update(summarise(window, cfg, T, B, ceiling))
            except Exception as err:  # record and go on with the next variant
                entry["error"] = f"{type(err).__name__}: {err}"
                entry["traceback"] = traceback.format_exc()[-3000:]
            entry.update(graph_breaks())
            entry["variant_s"] = time.perf_counter() - t0  # the whole variant: build, compile, warm-up, window
            result["runs"].append(entry)
            add_ratios(result["runs"])
            fname.write_text(json.dumps(result, indent=2))
            gc.collect()
            print(json.dumps({k: v for k, v in entry.items() if k != "traceback"}), flush=True)
    print(f"\n{'model':<11} {'variant':<24} {'tok/s':>10} {'ratio':>6} {'median':>6} {'MFU(989)':>8} {'mem GB':>7}")
    for r in result["runs"]:
        if "tokens_per_s" in r:
            print(f"{r['model']:<11} {r['variant']:<24} {r['tokens_per_s']:>10.0f} "
                  f"{r.get('ratio_vs_plain', float('nan')):>6.3f} {r.get('ratio_vs_plain_median_step', float('nan')):>6.3f} "
                  f"{r['mfu_causal_989']:>8.1%} {(r['peak_mem_gb'] or 0):>7.1f}")
        else:
            print(f"{r['model']:<11} {r['variant']:<24} ERROR {r['error'][:80]}")
    print("tok/s, ratio: tokens / wall time over the window (mean step); median: the ratio of median steps")
    print(f"wrote {fname}")


def add_ratios(runs: list[dict]) -> None:
    """Each run against the plain loop of the same model, by wall clock (``ratio_vs_plain``) and by the
    median step (``ratio_vs_plain_median_step``)."""
    for run in runs:
        # the plain loop with the same kernels / compile settings (the variant name with trainer -> plain)
        twin = run["variant"].replace("trainer", "plain").replace("-fp8", "")
        base = next((r for r in runs if r["model"] == run["model"] and r["variant"] == twin
                     and "tokens_per_s" in r), None)
        for fallback in (["plain-compile-model"] if run["variant"].endswith("-model") else []) + ["plain-compile"]:
            if base is None:
                base = next((r for r in runs if r["model"] == run["model"] and r["variant"] == fallback
                             and "tokens_per_s" in r), None)
        if base and "tokens_per_s" in run:
            run["baseline"] = base["variant"]
            run["ratio_vs_plain"] = run["tokens_per_s"] / base["tokens_per_s"]
            run["ratio_vs_plain_median_step"] = run["tokens_per_s_median_step"] / base["tokens_per_s_median_step"]


if __name__ == "__main__":
    main()
