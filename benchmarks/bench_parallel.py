"""ZeRO strategies against Lightning's own, side by side on one host (2x H200, NVLink).

    python benchmarks/bench_parallel.py --out DIR      # all variants, ~6-8 min on 2x H200
    python benchmarks/bench_parallel.py --smoke        # same code paths, tiny model, CPU/gloo

Every variant runs in its own freshly spawned group of ``--gpus`` processes (one per
GPU), so peak-memory figures are clean and one failing variant cannot take the others
down: its error is recorded in the JSON and the run goes on.

Per variant, inside Lightning's ``Trainer.fit`` (bf16-mixed, random tokens, AdamW):
gpt-1.3b, T=2048, B=8 per GPU; ``--warmup`` steps, then a window of ``--steps`` steps timed
by ``_timing.WallClockWindow`` (a device synchronisation and a barrier on every rank at both
ends only; rank 0's host clock between them), then one profiled step for the
exposed-communication share (NCCL kernel time not overlapped by any compute kernel, over the
mean step). The ``*_acc8_*`` variants accumulate 8 micro-batches per optimizer step, one per
``ZeroStrategy(accumulation=...)`` mode; their steps (warm-up, window and its ``step_ms_*``) are optimizer
steps, their CUDA-event step times (``step_s_median``) micro-batches, and the profiled step is the second
micro-batch of an optimizer step.

Headline: ``tokens_per_s``, the tokens of all ranks over the window's wall time (the mean step,
slow steps included), with ``step_ms_mean`` / ``_median`` / ``_p90`` / ``_max``, the garbage
collections and Dynamo recompilations inside the window (per rank), and every ratio from it.
The CUDA-event median step of the earlier results stays beside it: ``step_s_median`` and the
figures derived from it under ``*_median_step`` (``tokens_per_s_median_step``,
``speedup_vs_lightning_fsdp_full_shard_median_step``, ...).

Per variant, one more step starts from an idle GPU (after a synchronize) and records the host time
to issue it against its GPU time (``issue_s_and_probe_step_s_per_rank``: close means host-bound).

Reported: tokens/s (all GPUs), MFU per GPU (model FLOPs, causal attention counted once,
against the 989 TFLOP/s dense bf16 peak), peak allocated memory (max over ranks),
exposed communication %. Variants: Lightning ``ddp``, Lightning ``FSDPStrategy``
FULL_SHARD and SHARD_GRAD_OP (per-block wrap), Lightning ``DeepSpeedStrategy`` stage 2
(when DeepSpeed imports), ours ``zero1``/``zero2``/``zero3`` eager, ``zero3`` with the
Triton kernels + per-block ``torch.compile``, llama-8b under ``zero3`` (too large for
one GPU under ddp with Adam: 16 bytes/param = 128 GB), and ``zero1`` with bf16 / PowerSGD
gradient compression (speed, and the last step's loss beside uncompressed ``zero1``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import launch, read_ranks  # noqa: E402
from _timing import WallClockWindow, graph_breaks  # noqa: E402

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet

# name -> how to build it; "module" kwargs go to GPTLightningModule
VARIANTS: dict[str, dict[str, Any]] = {
    "lightning_ddp": {"strategy": "ddp"},
    "lightning_fsdp_full_shard": {"strategy": "fsdp_full"},
    "lightning_fsdp_shard_grad_op": {"strategy": "fsdp_grad_op"},
    "lightning_deepspeed_stage_2": {"strategy": "deepspeed_stage_2"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero3_compile": {"strategy": "zero3", "compile": "default"},
    "zero3_triton_compile": {"strategy": "zero3", "kernels": "triton", "compile": "default"},
    "zero2_triton_compile": {"strategy": "zero2", "kernels": "triton", "compile": "default"},
    # gradients reduce-scattered in bf16, as Lightning's FSDPStrategy does under bf16-mixed (ours: fp32 by default)
    "zero3_triton_compile_bf16_reduce": {"strategy": "zero3", "kernels": "triton", "compile": "default",
                                         "reduce_dtype": "bf16"},
    "zero2_triton_compile_bf16_reduce": {"strategy": "zero2", "kernels": "triton", "compile": "default",
                                         "reduce_dtype": "bf16"},
    # once compute is compiled, one block of prefetch may not hide the all-gathers: two blocks ahead
    "zero3_triton_compile_prefetch2": {"strategy": "zero3_prefetch2", "kernels": "triton", "compile": "default"},
    # FP8 linears in the blocks (GPTConfig(fp8=True)); everything else as the bf16 variants
    "zero3_triton_compile_fp8": {"strategy": "zero3", "kernels": "triton", "compile": "default", "fp8": True},
    "zero2_triton_compile_fp8": {"strategy": "zero2", "kernels": "triton", "compile": "default", "fp8": True},
    "zero3_triton_compile_fp8_bf16_reduce": {"strategy": "zero3", "kernels": "triton", "compile": "default",
                                             "fp8": True, "reduce_dtype": "bf16"},
    # ... with the FP8 weights all-gathered in FP8 (ZeroStrategy(fp8_all_gather=True)): half the gather bytes
    "zero3_triton_compile_fp8_gather": {"strategy": "zero3_fp8_gather", "kernels": "triton", "compile": "default",
                                        "fp8": True},
    "zero2_triton_compile_fp8_gather": {"strategy": "zero2_fp8_gather", "kernels": "triton", "compile": "default",
                                        "fp8": True},
    # ... with q/k/v as one linear (one amax and one cast of each block input instead of three)
    "zero3_triton_compile_fp8_qkv": {"strategy": "zero3", "kernels": "triton", "compile": "default", "fp8": True,
                                     "fused_qkv": True},
    "zero2_triton_compile_fp8_qkv": {"strategy": "zero2", "kernels": "triton", "compile": "default", "fp8": True,
                                     "fused_qkv": True},
    "zero3_triton_compile_fp8_gather_qkv": {"strategy": "zero3_fp8_gather", "kernels": "triton",
                                            "compile": "default", "fp8": True, "fused_qkv": True},
    "zero2_triton_compile_fp8_gather_qkv": {"strategy": "zero2_fp8_gather", "kernels": "triton",
                                            "compile": "default", "fp8": True, "fused_qkv": True},
    # ... with Python's garbage collector on a fixed schedule, the same on both ranks (GarbageCollection):
    # an automatic full collection pauses one rank's host while the other waits in the next collective
    "zero3_triton_compile_fp8_qkv_gc": {"strategy": "zero3", "kernels": "triton", "compile": "default", "fp8": True,
                                        "fused_qkv": True, "gc": 10},
    "zero2_triton_compile_fp8_qkv_gc": {"strategy": "zero2", "kernels": "triton", "compile": "default", "fp8": True,
                                        "fused_qkv": True, "gc": 10},
    "zero3_triton_compile_gc": {"strategy": "zero3", "kernels": "triton", "compile": "default", "gc": 10},
    "lightning_fsdp_full_shard_gc": {"strategy": "fsdp_full", "gc": 10},
    # ... with two blocks per FSDP2 unit: half the all-gathers / reduce-scatters and FSDP2 host work
    "zero3_triton_compile_fp8_qkv_gc_units2": {"strategy": "zero3_units2", "kernels": "triton", "compile": "default",
                                               "fp8": True, "fused_qkv": True, "gc": 10},
    "zero2_triton_compile_fp8_qkv_gc_units2": {"strategy": "zero2_units2", "kernels": "triton", "compile": "default",
                                               "fp8": True, "fused_qkv": True, "gc": 10},
    "zero3_triton_compile_fp8_qkv_units2": {"strategy": "zero3_units2", "kernels": "triton", "compile": "default",
                                            "fp8": True, "fused_qkv": True},
    "zero3_triton_compile_units2": {"strategy": "zero3_units2", "kernels": "triton", "compile": "default"},
    "zero3_triton_compile_gc_units2": {"strategy": "zero3_units2", "kernels": "triton", "compile": "default", "gc": 10},
    "llama8b_zero3": {"strategy": "zero3_meta", "preset": "llama-8b", "batch": 2, "ac": "full"},
    # Lightning's ModelParallelStrategy + FSDP2 (fully_shard per block, bf16 MixedPrecisionPolicy) + per-block
    # torch.compile + fused AdamW over the plain GPT (benchmarks/_baselines.py): the strongest Lightning-native path
    "lightning_model_parallel_compile": {"baseline": "model_parallel"},
    # the gpt-1.3b-zero3 recipe's model and strategy from Python, with the defaults a user gets (collection
    # schedule on), and the same with the schedule turned off (Python's automatic collector)
    "zero3_recipe": {"zero": {"stage": 3, "blocks_per_unit": 2}, "kernels": "triton", "compile": "default",
                     "fp8": "tensorwise", "fused_qkv": True},
    "zero3_recipe_fp8_gather": {"zero": {"stage": 3, "blocks_per_unit": 2, "fp8_all_gather": True},
                                "kernels": "triton", "compile": "default", "fp8": "tensorwise", "fused_qkv": True},
    **{f"zero3_recipe_ctas{n}": {"zero": {"stage": 3, "blocks_per_unit": 2}, "kernels": "triton",
                                 "compile": "default", "fp8": "tensorwise", "fused_qkv": True,
                                 "env": {"NCCL_MAX_CTAS": str(n)}} for n in (4, 8, 16)},
    # ... with each rank's process on the cores of its GPU's NUMA node (benchmarks/_affinity.py)
    "zero3_recipe_numa": {"zero": {"stage": 3, "blocks_per_unit": 2}, "kernels": "triton", "compile": "default",
                          "fp8": "tensorwise", "fused_qkv": True, "numa": True},
    "zero3_recipe_units4": {"zero": {"stage": 3, "blocks_per_unit": 4}, "kernels": "triton", "compile": "default",
                            "fp8": "tensorwise", "fused_qkv": True},
    "lightning_model_parallel_compile_numa": {"baseline": "model_parallel", "numa": True},
    "zero3_recipe_no_gc_schedule": {"zero": {"stage": 3, "blocks_per_unit": 2}, "kernels": "triton",
                                    "compile": "default", "fp8": "tensorwise", "fused_qkv": True, "gc_every": None},
    # llama-8b at T=8192, 2 sequences per GPU, ZeRO-3 built on meta: FP8 tensorwise + the pack's kernels +
    # per-block compile + selective checkpointing, the same in bf16, and the levers one at a time
    **{f"llama8b_zero3_{name}": {"preset": "llama-8b", "seq_len": 8192, "batch": 2, "warmup": 4, "steps": 8,
                                 "kernels": "triton", "attention": "auto", "compile": "default", **spec,
                                 "zero": {"stage": 3, "init": "meta", **spec.get("zero", {})}}
       for name, spec in {
           "fp8": {"fp8": "tensorwise", "fused_qkv": True, "ac": "selective"},
           "bf16": {"ac": "selective", "fused_qkv": True},
           "fp8_gather": {"fp8": "tensorwise", "fused_qkv": True, "ac": "selective",
                          "zero": {"fp8_all_gather": True}},
           "fp8_no_ac": {"fp8": "tensorwise", "fused_qkv": True, "ac": "none"},
           "fp8_no_ac_gather": {"fp8": "tensorwise", "fused_qkv": True, "ac": "none",
                                "zero": {"fp8_all_gather": True}},
           "fp8_gather_prefetch2": {"fp8": "tensorwise", "fused_qkv": True, "ac": "selective",
                                    "zero": {"fp8_all_gather": True, "prefetch": 2}},
           "fp8_prefetch2": {"fp8": "tensorwise", "fused_qkv": True, "ac": "selective", "zero": {"prefetch": 2}},
           "bf16_no_ac": {"ac": "none", "fused_qkv": True},
           # NCCL's kernels limited to a few CTAs (thread blocks, one SM each): the overlapped all-gathers
           # and reduce-scatters take fewer SMs from the matmuls beside them, at a lower bandwidth
           **{f"fp8_no_ac_gather_ctas{n}": {"fp8": "tensorwise", "fused_qkv": True, "ac": "none",
                                            "zero": {"fp8_all_gather": True}, "env": {"NCCL_MAX_CTAS": str(n)}}
              for n in (4, 8, 16)},
           **{f"bf16_no_ac_ctas{n}": {"ac": "none", "fused_qkv": True, "env": {"NCCL_MAX_CTAS": str(n)}}
              for n in (8, 16)},
           # three sequences per GPU: the per-step costs (optimizer, FP8 weight casts, launch) over more tokens
           "fp8_no_ac_gather_b3": {"fp8": "tensorwise", "fused_qkv": True, "ac": "none", "batch": 3,
                                   "zero": {"fp8_all_gather": True}},
           # bf16 at three sequences per GPU (selective checkpointing: without it the third does not fit)
           "bf16_b3": {"ac": "selective", "fused_qkv": True, "batch": 3},
           # gradients reduce-scattered in bf16 (half the bytes of the default fp32 reduction)
           "fp8_no_ac_gather_bf16_reduce": {"fp8": "tensorwise", "fused_qkv": True, "ac": "none",
                                            "zero": {"fp8_all_gather": True}, "reduce_dtype": "bf16"},
       }.items()},
    "llama8b_model_parallel_compile": {"baseline": "model_parallel", "preset": "llama-8b", "seq_len": 8192,
                                       "batch": 2, "warmup": 4, "steps": 8, "ac": "full"},
    # gradient accumulation, 8 micro-batches of 1 sequence per optimizer step, in each ZeroStrategy(accumulation=)
    # mode: gathers and reduce-scatters per micro-batch against memory held between them (warmup / steps and the
    # window's step times count optimizer steps; step_s_median is per micro-batch)
    **{f"zero3_acc8_{mode}": {"zero": {"stage": 3, "accumulation": mode}, "batch": 1, "accumulate": 8,
                              "warmup": 2, "steps": 4}
       for mode in ("reduce_each", "reduce_once", "gather_once")},
    **{f"llama8b_zero3_acc8_{mode}": {"preset": "llama-8b", "batch": 1, "accumulate": 8, "warmup": 2, "steps": 3,
                                      "ac": "full", "zero": {"stage": 3, "init": "meta", "accumulation": mode}}
       for mode in ("reduce_each", "reduce_once", "gather_once")},
    # gradient compression of the stage-1 all-reduce (last: skipped first when the budget runs out)
    "zero1_bf16_compression": {"strategy": "zero1_bf16"},
    "zero1_powersgd": {"strategy": "zero1_powersgd"},
}


def build_strategy(name: str, smoke: bool, spec: Optional[dict] = None, world: int = 1) -> Any:
    from lightning_perf.models.gpt.model import Block
    from lightning_perf.strategies import ZeroStrategy

    spec = spec or {}
    if spec.get("baseline") == "model_parallel":
        from _baselines import model_parallel_strategy

        return model_parallel_strategy(world)
    if "zero" in spec:  # ZeroStrategy's arguments, as a user writes them
        kwargs = dict(spec["zero"])
        if "gc_every" in spec:
            kwargs["gc_every_n_steps"] = spec["gc_every"]
        return ZeroStrategy(**kwargs)

    if name == "ddp":
        return "ddp"
    if name in ("fsdp_full", "fsdp_grad_op"):
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(
            sharding_strategy="FULL_SHARD" if name == "fsdp_full" else "SHARD_GRAD_OP",
            auto_wrap_policy={Block},
            state_dict_type="sharded",
        )
    if name == "deepspeed_stage_2":
        import deepspeed  # noqa: F401  (recorded as an error when absent)

        return "deepspeed_stage_2"
    if name == "zero3_meta":
        return ZeroStrategy(stage=3, init="meta")
    if name == "zero1_bf16":
        return ZeroStrategy(stage=1, gradient_compression="fp16" if smoke else "bf16")  # bf16 hook needs NCCL
    if name == "zero1_powersgd":
        return ZeroStrategy(stage=1, gradient_compression="powersgd", powersgd_rank=4)
    if name.endswith("_fp8_gather"):  # zero3_fp8_gather / zero2_fp8_gather
        return ZeroStrategy(stage=int(name[4]), fp8_all_gather=True)
    if "_units" in name:  # zero3_units2: two consecutive blocks per FSDP2 unit
        stage, units = name.split("_units")
        return ZeroStrategy(stage=int(stage[-1]), blocks_per_unit=int(units))
    if name.startswith("zero3_prefetch"):  # zero3_prefetch2: all-gathers two blocks ahead
        return ZeroStrategy(stage=3, prefetch=int(name[len("zero3_prefetch"):]))
    stage = int(name[-1])
    return ZeroStrategy(stage=stage)


class _Timer:
    """CUDA-event step times and one profiled step, as a Lightning callback."""

    def __new__(cls, warmup: int, steps: int, profile_dir: Optional[str]):
        import lightning as L

        class Timer(L.Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self.events: list[tuple[Any, Any]] = []
                self.host: list[list[float]] = []  # host time to issue each step (~ the step: host-bound)
                self.profile_events: Optional[list[dict]] = None
                self.prof = None

            def on_train_start(self, trainer, pl_module):
                if torch.cuda.is_available():  # training peak only, not the one-off init copy
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == warmup + steps and torch.cuda.is_available():
                    # the probe step starts from an idle GPU: its host time is the cost of issuing one
                    # step (in steady state the launch queue paces the host to the GPU either way)
                    torch.cuda.synchronize()
                self.host.append([time.perf_counter(), 0.0])
                if torch.cuda.is_available():
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                    self.events.append((start, None))
                else:
                    self.events.append((time.perf_counter(), None))
                if profile_dir is not None and batch_idx == warmup + steps + 1:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                    self.prof = profile(activities=acts)
                    self.prof.__enter__()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.host[-1][1] = time.perf_counter()
                start, _ = self.events[-1]
                if torch.cuda.is_available():
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self.events[-1] = (start, end)
                else:
                    self.events[-1] = (start, time.perf_counter())
                if self.prof is not None:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    self.prof.__exit__(None, None, None)
                    path = os.path.join(profile_dir, f"trace_rank{trainer.global_rank}.json")
                    self.prof.export_chrome_trace(path)
                    with open(path) as f:
                        self.profile_events = json.load(f).get("traceEvents", [])
                    self.prof = None

            def step_times(self) -> list[float]:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    out = [s.elapsed_time(e) / 1e3 for s, e in self.events if e is not None]
                else:
                    out = [e - s for s, e in self.events if e is not None]
                return out[warmup:warmup + steps]

            def host_times(self) -> list[float]:
                return [b - a for a, b in self.host][warmup:warmup + steps]

            def probe(self) -> tuple[Optional[float], Optional[float]]:
                """(host seconds to issue the probe step from an idle GPU, its GPU step seconds)."""
                if len(self.host) <= warmup + steps or not torch.cuda.is_available():
                    return None, None
                a, b = self.host[warmup + steps]
                s, e = self.events[warmup + steps]
                return b - a, s.elapsed_time(e) / 1e3

        return Timer()


def _worker(rank: int, world: int, port: int, variant: str, spec: dict, args: dict, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    os.environ.update(spec.get("env", {}))  # read when the process group's communicators are created
    result: dict[str, Any] = {"variant": variant, "env": spec.get("env", {})}
    result["cpus_allowed"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if spec.get("numa") and not args["smoke"]:  # this rank on its GPU's NUMA node (before any thread starts)
        from _affinity import bind_to_device, device_local_cpus

        local = device_local_cpus(rank)
        result["gpu_local_cpus"] = len(local) if local else None
        bound = bind_to_device(rank)
        result["cpus_bound"] = len(bound) if bound else None
    try:
        import lightning as L
        from torch.utils.data import DataLoader, Dataset

        import lightning_perf  # noqa: F401  (registers the strategy names)
        from lightning_perf.models.gpt import GPTConfig
        from lightning_perf.models.gpt.module import GPTLightningModule
        from lightning_perf.strategies import register_strategies

        register_strategies()
        smoke = args["smoke"]
        preset = spec.get("preset", args["preset"])
        T = spec.get("seq_len", args["seq_len"]) if not smoke else args["seq_len"]
        B = spec.get("batch", args["batch"]) if not smoke else args["batch"]
        warmup = spec.get("warmup", args["warmup"]) if not smoke else args["warmup"]
        steps = spec.get("steps", args["steps"]) if not smoke else args["steps"]
        overrides: dict[str, Any] = {"block_size": max(T, 16)}
        if "kernels" in spec:
            overrides["kernels"] = spec["kernels"]
        if spec.get("fp8"):
            overrides["fp8"] = spec["fp8"]
        if "attention" in spec:
            overrides["attention"] = spec["attention"]
        if spec.get("fused_qkv"):
            overrides["fused_qkv"] = True
        if smoke:
            config = GPTConfig.from_name("tiny-llama" if "llama" in preset else "tiny", **overrides)
        else:
            config = GPTConfig.from_name(preset, **overrides)

        pool = torch.randint(0, config.vocab_size, (64, T + 1), generator=torch.Generator().manual_seed(rank))

        class Tokens(Dataset):  # random tokens from a small pool: no data cost in the step
            def __len__(self) -> int:
                return 10**6

            def __getitem__(self, i: int):
                x = pool[i % len(pool)]
                return x[:-1], x[1:]

        L.seed_everything(0, verbose=False)
        precision: dict[str, Any] = {"precision": "bf16-mixed" if not smoke else "32-true"}
        if spec.get("baseline") == "model_parallel":
            from _baselines import ModelParallelGPT

            # the MixedPrecisionPolicy casts (bf16 compute, fp32 master weights and reduction): no autocast
            module = ModelParallelGPT(config, compile=None if smoke else "default",
                                      activation_checkpointing=spec.get("ac", "none"))
            precision = {"precision": "32-true"}
        else:
            gc_kwargs = {"gc_every_n_steps": spec["gc_every"]} if "gc_every" in spec else {}
            module = GPTLightningModule(config, warmup_steps=0, compile=spec.get("compile"),
                                        activation_checkpointing=spec.get("ac", "none"), **gc_kwargs)
        accumulate = spec.get("accumulate", 1)  # the timer counts micro-batches, the window optimizer steps
        timer = _Timer(warmup * accumulate, steps * accumulate, args["profile_dir"])
        window = WallClockWindow(warmup=warmup, steps=steps, checkpoint=False)
        accelerator = "cpu" if smoke else "gpu"
        if spec.get("reduce_dtype"):  # our precision plugin with a gradient-reduction dtype of its own
            from lightning_perf.plugins import PerfPrecision

            precision = {"plugins": [PerfPrecision(precision["precision"],
                                                   reduce_dtype=getattr(torch, spec["reduce_dtype"].replace(
                                                       "bf16", "bfloat16")))]}
        gc_callbacks = []
        if spec.get("gc"):
            from lightning_perf.callbacks import GarbageCollection

            gc_callbacks = [GarbageCollection(every_n_steps=int(spec["gc"]))]
        trainer = L.Trainer(
            accelerator=accelerator, devices=world, strategy=build_strategy(spec.get("strategy", ""), smoke, spec, world),
            max_steps=warmup + steps + 2, accumulate_grad_batches=accumulate, **precision,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, window] + gc_callbacks,
        )
        loader = DataLoader(Tokens(), batch_size=B, num_workers=0, pin_memory=not smoke)
        t0 = time.perf_counter()
        trainer.fit(module, loader)
        times = timer.step_times()
        step = statistics.median(times)
        tokens_per_s_median_step = world * B * T / step
        flops_per_token = config.flops_per_token(T)
        # the headline: this rank's window (opened and closed together on every rank), tokens of all ranks
        result.update(window.result)
        tokens_per_s = result["tokens_per_s"]
        mean_step = result["step_ms_mean"] / 1e3
        if torch.cuda.is_available():  # since training started, as before the window reset the counter
            result["peak_mem_gb_window"] = result["peak_mem_gb"]
            result["peak_mem_gb"] = max(torch.cuda.max_memory_allocated() / 1e9, result["peak_mem_gb_before_window"])
        strategy = trainer.strategy
        result.update(
            ok=True,
            rank=rank,
            preset=config.name,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            accumulation=getattr(strategy, "accumulation_mode", None),
            batch_per_gpu=B,
            seq_len=T,
            world=world,
            step_s_median=step,
            step_s_min=min(times),
            step_s_max=max(times),
            host_step_s_median=statistics.median(timer.host_times()),
            issue_s=timer.probe()[0],
            probe_step_s=timer.probe()[1],
            tokens_per_s_median_step=tokens_per_s_median_step,
            mfu=flops_per_token * tokens_per_s / world / PEAK_BF16,
            mfu_median_step=flops_per_token * tokens_per_s_median_step / world / PEAK_BF16,
            mfu_attention_twice=config.flops_per_token_full_attention(T) * tokens_per_s / world / PEAK_BF16,
            fit_s=time.perf_counter() - t0,
            final_loss=float(trainer.callback_metrics["train/loss"]) if "train/loss" in trainer.callback_metrics
            else None,
        )
        if timer.profile_events:
            from lightning_perf.perf.comm import analyze_comm_trace

            analysis = analyze_comm_trace(timer.profile_events, ranks=world)
            result["exposed_comm_pct"] = 100.0 * analysis.overlap.exposed / mean_step
            result["exposed_comm_pct_median_step"] = 100.0 * analysis.overlap.exposed / step
            result["comm_overlap_pct"] = 100.0 * analysis.overlap.overlap_fraction
            from lightning_perf.perf.gpu_time import gpu_time_breakdown

            result["gpu_time"] = gpu_time_breakdown(timer.profile_events, steps=1, top=25)
            result["host_top_ms"] = _host_top(timer.profile_events)
    except BaseException as e:  # recorded, never fatal for the whole run
        result.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    result.update(graph_breaks())  # this process ran only this variant: the whole tally is its own
    with open(f"{out_file}.rank{rank}", "w") as f:
        json.dump(result, f)


def _host_top(events: list[dict], top: int = 30) -> dict[str, float]:
    """Host milliseconds of the profiled step by operator / annotation name, exclusive (a name's own
    time, less the time of what it called on the same thread), the largest first: where a
    host-bound step goes (Python between operators counts to the operator or annotation around it)."""
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    totals: dict[str, float] = {}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[list] = []  # [end, name, children's time]

        def close(until: float) -> None:
            while stack and stack[-1][0] <= until:
                end_, name, children, dur = stack.pop()
                totals[name] = totals.get(name, 0.0) + max(dur - children, 0.0) / 1e3
                if stack:
                    stack[-1][2] += dur

        for e in evs:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
            close(ts)
            stack.append([ts + dur, e.get("name", "?"), 0.0, dur])
        close(float("inf"))
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def run_variant(variant: str, spec: dict, args: dict, world: int, timeout: float) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"bench_{variant}_")
    out_file = os.path.join(tmp, "result")
    args = dict(args, profile_dir=tmp)
    error = launch(_worker, (variant, spec, args, out_file), world, timeout)
    return merge_ranks(variant, read_ranks(lambda r: f"{out_file}.rank{r}", world), error)


def merge_ranks(variant: str, results: list[dict], error: str | None) -> dict:
    """One row from the ranks' results: rank 0's window (the headline), memory and exposed communication
    at their maximum over ranks, and per rank what explains a slow window."""
    if not results:
        return {"variant": variant, "ok": False, "error": error or "no result"}
    merged = dict(results[0])
    mems = [r.get("peak_mem_gb") for r in results if r.get("peak_mem_gb") is not None]
    if mems:
        merged["peak_mem_gb"] = max(mems)
    exposed = [r.get("exposed_comm_pct") for r in results if r.get("exposed_comm_pct") is not None]
    if exposed:
        merged["exposed_comm_pct"] = max(exposed)
        merged["exposed_comm_pct_per_rank"] = exposed
        merged["exposed_comm_pct_median_step"] = max(r["exposed_comm_pct_median_step"] for r in results
                                                     if r.get("exposed_comm_pct") is not None)
    for key in ("gc_count_in_window", "gc_ms_in_window", "recompiles_in_window"):
        if any(key in r for r in results):
            merged[f"{key}_per_rank"] = [r.get(key) for r in results]
    hosts = [r.get("host_step_s_median") for r in results if r.get("host_step_s_median") is not None]
    if hosts:
        merged["host_step_s_median_per_rank"] = hosts
    issue = [(r.get("issue_s"), r.get("probe_step_s")) for r in results if r.get("issue_s") is not None]
    if issue:  # issue time close to the probe step: the host sets the pace
        merged["issue_s_and_probe_step_s_per_rank"] = issue
    merged["gpu_time_per_rank"] = [r.get("gpu_time") for r in results]
    merged["host_top_ms_per_rank"] = [r.get("host_top_ms") for r in results]
    merged["cpus_per_rank"] = [(r.get("cpus_allowed"), r.get("gpu_local_cpus"), r.get("cpus_bound")) for r in results]
    if error and merged.get("ok"):
        merged["warning"] = error
    elif error:
        merged.setdefault("error", error)
    return merged


def add_ratios(results: list[dict]) -> None:
    """Each variant against Lightning's FSDP FULL_SHARD of the same run: by wall clock and, under
    ``*_median_step``, by the median step; and by wall clock against Lightning's ModelParallelStrategy
    + FSDP2 + compile of the same model and run (``speedup_vs_lightning_model_parallel``)."""
    base = next((r for r in results if r["variant"] == "lightning_fsdp_full_shard" and r.get("ok")), None)
    for r in results:
        preset = r.get("preset")
        mp = next((b for b in results if b.get("ok") and b.get("preset") == preset
                   and b["variant"].endswith("model_parallel_compile")), None)
        if mp is not None and r.get("ok"):
            r["speedup_vs_lightning_model_parallel"] = r["tokens_per_s"] / mp["tokens_per_s"]
        if base and r.get("ok"):
            r["speedup_vs_lightning_fsdp_full_shard"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["speedup_vs_lightning_fsdp_full_shard_median_step"] = (r["tokens_per_s_median_step"]
                                                                     / base["tokens_per_s_median_step"])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU processes (gloo)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--preset", default="gpt-1.3b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per variant (x2 for compile/llama)")
    parser.add_argument("--budget", type=float, default=510.0, help="seconds for the whole run; later variants skip")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run")
    a = parser.parse_args(argv)
    if a.smoke:
        a.seq_len, a.batch, a.warmup, a.steps = 32, 2, 1, 2
    args = {"smoke": a.smoke, "preset": a.preset, "seq_len": a.seq_len, "batch": a.batch, "warmup": a.warmup,
            "steps": a.steps}
    names = a.only or list(VARIANTS)
    results = []
    start = time.perf_counter()
    for name in names:
        if name not in VARIANTS:
            results.append({"variant": name, "ok": False, "error": f"unknown variant; known: {sorted(VARIANTS)}"})
            continue
        if time.perf_counter() - start > a.budget:
            results.append({"variant": name, "ok": False, "error": f"skipped: run budget {a.budget:.0f}s spent"})
            print(f"[{name}] skipped (budget)", flush=True)
            continue
        t0 = time.perf_counter()
        timeout = a.timeout * (2 if "llama" in name or "compile" in name else 1)
        r = run_variant(name, VARIANTS[name], args, a.gpus, timeout)
        r["variant_s"] = time.perf_counter() - t0  # the whole variant: spawn, build, warm-up, window, probe
        results.append(r)
        status = f"{r['tokens_per_s']:.0f} tok/s" if r.get("ok") else f"FAILED {r.get('error', '')[:200]}"
        print(f"[{name}] {status} ({r['variant_s']:.0f}s)", flush=True)
    add_ratios(results)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = {
        "benchmark": "bench_parallel",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpus": a.gpus,
        "torch": torch.__version__,
        "triton": triton_version,
        "config": {**args, "variants": names, "peak_flops": PEAK_BF16},
        "headline": "tokens / wall-clock seconds over the timed window (mean step), rank 0's clock",
        "results": results,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"bench_parallel{'_smoke' if a.smoke else ''}_{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\n{'variant':32s} {'tok/s':>10s} {'MFU':>7s} {'mem GB':>8s} {'exp.comm':>9s} {'vs FSDP':>8s} {'vs MP':>8s} {'loss':>7s}")
    for r in results:
        if not r.get("ok"):
            print(f"{r['variant']:32s} failed: {r.get('error', '')[:80]}")
            continue
        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        exp = f"{r['exposed_comm_pct']:.1f}%" if r.get("exposed_comm_pct") is not None else "-"
        sp = f"{r['speedup_vs_lightning_fsdp_full_shard']:.2f}x" if "speedup_vs_lightning_fsdp_full_shard" in r else "-"
        loss = f"{r['final_loss']:.3f}" if r.get("final_loss") is not None else "-"
        tps, mfu = f"{r['tokens_per_s']:10.0f}", f"{100 * r['mfu']:6.1f}%"
        mp = r.get("speedup_vs_lightning_model_parallel")
        mp = f"{mp:.3f}x" if mp is not None else "-"
        print(f"{r['variant']:32s} {tps} {mfu} {mem:>8s} {exp:>9s} {sp:>8s} {mp:>8s} {loss:>7s}")
    print("\nwhere rank 0's profiled step goes (GPU ms per step by kernel category; idle: no kernel running)")
    for r in results:
        g = (r.get("gpu_time_per_rank") or [None])[0] if r.get("ok") else None
        if not g:
            continue
        cats = ", ".join(f"{k} {v:.0f}" for k, v in g["ms_per_step"].items() if v >= 0.5)
        exp = f"{r['exposed_comm_pct']:.1f}%" if r.get("exposed_comm_pct") is not None else "-"
        print(f"{r['variant']:32s} window {g['window_ms_per_step']:.0f} ms, idle {g['idle_ms_per_step']:.0f}, "
              f"exposed comm {exp}: {cats}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
