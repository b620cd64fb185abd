"""The GPT through the Lightning Trainer against a plain PyTorch loop over the same model, same run; and,
with ``--profile``, where the plain loop's step spends its time.

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

``--profile`` runs one question about the plain loop's step instead (bf16 autocast, fused AdamW,
the model compiled per block or whole, fixed random tokens), per model of ``--models``:

- ``ops``: which of the pack's kernels helps or hurts the whole step, one op at a time: the model
  with ``kernels="triton"`` but every op outside a set routed to the PyTorch reference (``--sets``:
  ``torch``, ``all``, ``each`` op alone; a ``+fp8`` / ``+delayed`` suffix adds tensorwise /
  delayed-scaling FP8 linears), the median step of each; for the sets in ``--trace-sets`` two
  more steps under ``torch.profiler``: GPU time by kernel category (matmuls, attention, Inductor,
  the pack's kernels, optimizer, idle; ``lightning_perf.perf.gpu_time``) and the top operators;
- ``gc``: what a step leaves for Python's garbage collector, per kernel choice (PyTorch's; the pack's
  with fused q/k/v): after warm-up everything alive is frozen with the collector off, ``--steps``
  more steps run, and the objects they leave are counted by type and function, before one timed
  collection;
- ``host``: where the host's time goes, bf16 against FP8 linears: the host time to issue one step
  (nothing waited for) against the device step time, one profiled step's top host operators, and
  the host microseconds per call of the FP8 pieces called eagerly at gpt2-124m size (the cast-
  transpose op and its launch alone, the amax, the weight cast, ``torch._scaled_mm``, ``fp8_linear``).

    python benchmarks/bench_gpt.py --out $OUT                      # both models, default variants
    python benchmarks/bench_gpt.py --out $OUT --models gpt2-124m:1024:16 --steps 60 --warmup 20
    python benchmarks/bench_gpt.py --profile ops --models gpt-1.3b:2048:8 --scope model --fused-qkv \
        --sets torch,all,all+fp8 --trace-sets all,all+fp8                 # where FP8 saves time, and where not
    python benchmarks/bench_gpt.py --profile gc --steps 10             # the collector's work per step
    python benchmarks/bench_gpt.py --profile host --steps 10           # host against device time, bf16 / FP8
    python benchmarks/bench_gpt.py --smoke                         # CPU, tiny, checks the code paths
    python benchmarks/bench_gpt.py --smoke --profile ops           # (also gc, host)
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

from lightning_perf.kernels.ops import fp8_casts as _f8  # noqa: E402
from lightning_perf.kernels.ops import fp8_linear as _f8_linear  # noqa: E402

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
    from lightning_perf.parallel.compute.compile import apply_compile

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


# ---- where the plain loop's step spends its time (--profile) -------------------------------------------

OPS = ("attention", "norm", "mlp_activation", "lm_loss")


def _fixed_step(model, opt, x, y, device, clip: bool = False):
    """One step of the plain loop on the same tokens each time (bf16 autocast on a GPU)."""
    amp = device.type == "cuda"

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _built(cfg, seq_len, batch, device, compiled):
    """The GPT of ``cfg`` on ``device`` as ``compiled(model)`` returns it to be called, fused AdamW, fixed tokens."""
    from lightning_perf.models import GPT

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    return compiled(model), opt, x, y


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_ops(name, seq_len, batch, steps, warmup, device, args, compile_mode) -> list[dict]:
    """``--profile ops``: the median step per op set, a profiled breakdown for ``--trace-sets``."""
    from _timing import StepTimer
    from torch.profiler import ProfilerActivity, profile

    from lightning_perf.kernels import dispatch
    from lightning_perf.models import GPTConfig
    from lightning_perf.parallel.compute.compile import apply_compile
    from lightning_perf.perf.gpu_time import gpu_time_breakdown

    sets = []  # (label, enabled ops, fp8)
    for chosen in args.sets.split(","):
        base, _, suffix = chosen.partition("+")
        fp8 = {"fp8": "tensorwise", "delayed": "delayed"}.get(suffix, args.fp8)
        if suffix not in ("", "fp8", "delayed") or base not in ("torch", "all", "each"):
            raise SystemExit(f"--sets: unknown set {chosen!r} (torch, all, each; suffix +fp8 or +delayed)")
        if base == "each":
            sets += [(op + (f"+{suffix}" if suffix else ""), {op}, fp8) for op in OPS]
        else:
            sets.append((chosen, set(OPS) if base == "all" else set(), fp8))
    cuda = device.type == "cuda"
    original = dispatch.default_dispatcher()
    rows = []
    for label, enabled, fp8 in sets:
        row = {"set": label, "ops": "+".join(sorted(enabled)) or "torch", "fp8": fp8}
        try:
            # only the enabled ops reach the pack's kernels; the others return None: the reference path
            d = dispatch.KernelDispatcher(elementwise_under_compile=args.elementwise_under_compile)
            for op in OPS:
                if op not in enabled:
                    setattr(d, op, lambda *a, **k: None)
            dispatch.set_default_dispatcher(d)
            torch._dynamo.reset()
            cfg = GPTConfig.from_name(name, kernels="triton" if enabled else "torch",
                                      attention=args.attention if "attention" in enabled else "sdpa", fp8=fp8,
                                      fused_qkv=args.fused_qkv)
            model, opt, x, y = _built(cfg, seq_len, batch, device, lambda m: apply_compile(
                list(m.blocks.values()) if args.scope == "block" else [m], compile_mode) or m)
            step = _fixed_step(model, opt, x, y, device)
            timer = StepTimer(cuda)
            for _ in range(warmup + steps):
                timer.mark()
                step()
            timer.mark()
            times = timer.step_times(skip=warmup)
            row.update(step_ms_median=1e3 * statistics.median(times), step_ms_min=1e3 * min(times),
                       step_ms_max=1e3 * max(times))
            if label in args.trace_sets.split(","):
                _sync(device)
                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    for _ in range(2):
                        step()
                    _sync(device)
                row["top_ops"] = prof.key_averages().table(
                    sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40,
                    max_name_column_width=70)
                trace = Path(args.out) / f"trace_{label.replace('+', '_')}.json"
                prof.export_chrome_trace(str(trace))
                row["breakdown"] = gpu_time_breakdown(json.loads(trace.read_text()).get("traceEvents", []), steps=2)
                trace.unlink()
                print(row["top_ops"], flush=True)
            model = opt = step = None  # free before the next set
        except Exception as err:  # keep the other sets
            row.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:])
        finally:
            dispatch.set_default_dispatcher(original)
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("top_ops", "breakdown", "traceback")}),
              flush=True)
    first = rows[0].get("step_ms_median") if rows else None
    for r in rows:
        if first and "step_ms_median" in r:
            r["speedup_vs_first"] = first / r["step_ms_median"]
    return rows


def profile_gc(name, seq_len, batch, steps, warmup, device, args, compile_mode) -> list[dict]:
    """``--profile gc``: the objects ``steps`` steps leave for the collector, per kernel choice."""
    import collections

    from lightning_perf.models import GPTConfig

    rows = []
    for kernels, extra in (("torch", {}), ("triton", {"fused_qkv": True})):
        torch._dynamo.reset()
        cfg = GPTConfig.from_name(name, kernels=kernels, attention="auto" if kernels == "triton" else "sdpa", **extra)
        model, opt, x, y = _built(cfg, seq_len, batch, device, lambda m: torch.compile(m) if compile_mode else m)
        step = _fixed_step(model, opt, x, y, device, clip=True)
        for _ in range(warmup):
            step()
        _sync(device)
        gc.collect()
        gc.disable()
        gc.freeze()
        try:
            for _ in range(steps):
                step()
            _sync(device)
            objs = gc.get_objects()
            types = collections.Counter(type(o).__name__ for o in objs)
            funcs = collections.Counter(f"{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', '?')}"
                                        for o in objs if type(o).__name__ == "function")
            owners: collections.Counter = collections.Counter()  # the functions whose closures hold the cells
            for o in objs:
                if type(o).__name__ == "cell":
                    for r in gc.get_referrers(o)[:2]:
                        if type(r).__name__ == "tuple":
                            for f in gc.get_referrers(r)[:2]:
                                if type(f).__name__ == "function":
                                    owners[f"{f.__module__}.{f.__qualname__}"] += 1
                    if sum(owners.values()) > 20000:
                        break
            n = len(objs)
            del objs
            t = time.perf_counter()
            freed = gc.collect()
            pause = time.perf_counter() - t
        finally:
            gc.unfreeze()
            gc.enable()
        rows.append({"kernels": kernels, "extra": extra, "steps": steps, "tracked_objects": n, "per_step": n / steps,
                     "collected": freed, "collect_ms": 1e3 * pause, "types": types.most_common(20),
                     "functions": funcs.most_common(20), "cell_owners": owners.most_common(10)})
        print(json.dumps({k: rows[-1][k] for k in ("kernels", "per_step", "collect_ms")}), flush=True)
        print(json.dumps(rows[-1]["functions"][:8]), flush=True)
        model = opt = step = None
    return rows


def _host_us(fn, device, n: int = 300) -> float:
    """Host microseconds per call; on a GPU kept busy by queued matmuls, so the calls only queue."""
    for _ in range(10):
        fn()
    _sync(device)
    if device.type == "cuda":
        big = torch.empty(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(20):  # tens of ms of queued GPU work: the calls below never wait for the GPU
            big @ big
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    _sync(device)
    return 1e6 * dt / n


def profile_host(name, seq_len, batch, steps, warmup, device, args, compile_mode) -> dict:
    """``--profile host``: host time per FP8 piece, and host against device time per step, bf16 and FP8."""
    from _timing import StepTimer
    from torch.profiler import ProfilerActivity, profile

    from lightning_perf.models import GPTConfig

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    M, K, N = (16384, 768, 3072) if cuda else (64, 32, 48)  # gpt2-124m's MLP up projection
    x, w = torch.randn(M, K, device=device, dtype=dtype), torch.randn(N, K, device=device, dtype=dtype)
    scale = _f8._scale_of(x, _f8.E4M3)
    q, _ = _f8.cast_transpose_fp8(x, scale, _f8.E4M3)
    wq, winv = _f8.quantize_fp8(w, _f8.E4M3)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    micro = {
        "cast_transpose_fp8 (custom op)": lambda: _f8.cast_transpose_fp8(x, scale, _f8.E4M3),
        # the kernel's own launch, without the op around it (a GPU launch: off the GPU the op runs its reference)
        **({"cast_transpose launch only": lambda: _f8._cast_transpose_launch(x, scale, _f8.E4M3)} if cuda else {}),
        "scale_of (amax)": lambda: _f8._scale_of(x, _f8.E4M3),
        "quantize_fp8 (weight)": lambda: _f8.quantize_fp8(w, _f8.E4M3),
        "_scaled_mm": lambda: torch._scaled_mm(q, wq.t(), scale_a=scale.reciprocal(), scale_b=winv,
                                               out_dtype=torch.bfloat16, use_fast_accum=cuda),
        "bf16 matmul": lambda: x @ w.t(),
        "fp8_linear forward (eager)": lambda: _f8_linear.fp8_linear(xr, wr),
        "F.linear forward (eager)": lambda: torch.nn.functional.linear(xr, wr),
    }
    report = {"micro_host_us": {k: _host_us(fn, device, n=300 if cuda else 5) for k, fn in micro.items()},
              "micro_shape": [M, K, N], "steps": []}
    print(json.dumps(report["micro_host_us"], indent=1), flush=True)
    for fp8 in (False, True):
        torch._dynamo.reset()
        cfg = GPTConfig.from_name(name, block_size=seq_len, fp8=fp8)
        model, opt, x, y = _built(cfg, seq_len, batch, device, lambda m: torch.compile(m) if compile_mode else m)
        step = _fixed_step(model, opt, x, y, device)
        for _ in range(warmup):
            step()
        _sync(device)
        host, timer = [], StepTimer(cuda)
        for _ in range(steps):
            timer.mark()
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            timer.mark()
            _sync(device)
        device_s = timer.step_times()[::2]  # (step start, step end) pairs
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            _sync(device)
        top = [{"name": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "cpu_total_ms": e.cpu_time_total / 1e3}
               for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:30]]
        row = {"fp8": fp8, "host_step_ms_median": 1e3 * statistics.median(host),
               "device_step_ms_median": 1e3 * statistics.median(device_s), "top_host_ops": top}
        report["steps"].append(row)
        print(f"fp8={fp8}: host {row['host_step_ms_median']:.1f} ms, device {row['device_step_ms_median']:.1f} ms",
              flush=True)
        for op in top[:15]:
            print(f"   {op['self_cpu_ms']:8.2f} ms {op['calls']:6d}x  {op['name'][:90]}")
        model = opt = step = None
        if cuda:
            torch.cuda.empty_cache()
    return report


PROFILES = {"ops": profile_ops, "gc": profile_gc, "host": profile_host}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--models", default="gpt2-124m:1024:16,gpt-1.3b:2048:8")
    p.add_argument("--variants", default="plain-compile,trainer-compile,trainer-triton-compile")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, eager, to check the code paths")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="where the plain loop's step spends its time instead of the variants (module docstring)")
    p.add_argument("--sets", default="torch,all,each", help="--profile ops: op sets to time (torch, all, each; "
                   "+fp8 / +delayed: with tensorwise / delayed FP8 linears)")
    p.add_argument("--trace-sets", default="all", help="--profile ops: sets to profile (GPU time by category)")
    p.add_argument("--scope", default="block", choices=("block", "model"), help="--profile ops: compile scope")
    p.add_argument("--attention", default="auto", help="--profile ops: the attention of sets with attention")
    p.add_argument("--fp8", nargs="?", const="tensorwise", default=False, choices=("tensorwise", "rowwise", "delayed"),
                   help="--profile ops: FP8 linears in every set (bare --fp8: tensorwise)")
    p.add_argument("--fused-qkv", action="store_true", help="--profile ops: q/k/v from one linear")
    p.add_argument("--elementwise-under-compile", default="inductor", choices=("inductor", "triton"),
                   help="--profile ops: inside compiled regions, norms / activations to Inductor or the pack's kernels")
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
    if args.profile:
        run_profile(args, device, result, out)
        return
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


def run_profile(args, device, result: dict, out: Path) -> None:
    """``--profile``: the chosen profile per model, one JSON (rewritten after each model)."""
    fname = out / f"bench_gpt_profile-{args.profile}{args.tag}{'_smoke' if args.smoke else ''}.json"
    for key in ("headline", "runs"):
        result.pop(key)
    result.update(profile=args.profile, args={k: v for k, v in vars(args).items() if k != "out"}, models=[])
    compile_mode = None if args.smoke else "default"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    for spec in args.models.split(","):
        name, T, B = spec.split(":")
        entry = {"model": name, "seq_len": int(T), "batch": int(B)}
        try:
            entry["result"] = PROFILES[args.profile](name, int(T), int(B), args.steps, args.warmup, device, args,
                                                     compile_mode)
        except Exception as err:  # record and go on with the next model
            entry.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:])
            print(entry["traceback"], flush=True)
        result["models"].append(entry)
        fname.write_text(json.dumps(result, indent=1))
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
