"""Tensor, pipeline and data parallelism side by side on one host (2x H200, NVLink).

    python benchmarks/bench_parallel3d.py --out DIR     # every variant, ~6-8 min on 2x H200
    python benchmarks/bench_parallel3d.py --out DIR --only 'dp2*,tp2*,pp2_1f1b_m4*' --no-llama
    python benchmarks/bench_parallel3d.py --smoke       # same code paths, tiny models, CPU/gloo
    python benchmarks/bench_parallel3d.py --out DIR --global-batch-tokens --warmup 2 --steps 3   # ~6 min

All variants train inside Lightning's ``Trainer.fit`` with ``Parallel3DStrategy``
(bf16-mixed, random tokens, AdamW, eager unless ``_compile``, parameters built on meta and initialised
on the GPUs). gpt-1.3b (untied head, so every layout runs the same model) sees the
same global batch of 16 x 2048 tokens per step in every layout:

- ``dp2``: 8 sequences per GPU, FSDP2 (ZeRO-2) over the two GPUs: the baseline;
- ``tp2``: 16 sequences, both GPUs split every layer (sequence parallel);
- ``pp2_<schedule>_m<m>``: 16 sequences in ``m`` microbatches through 2 stages, for
  1F1B (m = 4 and 8), GPipe and interleaved 1F1B (2 stages per GPU) at m = 4;
- ``pp2_auto``: the strategy's default pipeline (schedule, microbatches and stages per GPU
  ``"auto"``, chosen from the batch shape the data module states: interleaved 1F1B, 2 stages per
  GPU, 4 microbatches of 8192 tokens at this shape); the choice is recorded in the row
  (``schedule``, ``microbatches``, ``stages_per_rank``, ``pipeline_choice``);
- ``*_compile``: dp2, tp2 and pp2 1F1B m=4 again with the strategy's ``compile="default"``
  (inductor per block, under TP with the TP hooks inside the graph; after TP and before
  FSDP2), against their eager runs in the same group (eager DTensor dispatch starves tp2's
  GPU); tp2 ablations: async TP, the collectives left where issued (``_no_reorder``) or
  placed by Inductor's runtime-estimated scheduler (``_schedule``), sublayer compile scope,
  the residual stream sharded along the batch instead of the sequence (``_batch``), q/k/v from one
  matmul (``_fused_qkv``, dp2 too); ``_fp8``: FP8 linears (dp2 also gathers its weights in FP8).

At a real global batch (``--global-batch-tokens [N]``, default 262,144 tokens per GPU: 524,288 on two
GPUs; the ``gb_*`` variants, also selected by ``--only 'gb_*'``), every layout trains on the same N tokens
per optimizer step: ``gb_dp2_zero3_compile`` is ``ZeroStrategy(stage=3, accumulation="auto")`` accumulating
micro-batches of 8 sequences per GPU (the memory planner chooses what stays gathered between them),
``gb_dp2_zero2_compile`` the same through ``Parallel3DStrategy``'s data-parallel path, ``gb_pp2_1f1b_compile``
one batch per step cut into microbatches of 4 sequences (64 on two GPUs; ``gb_pp2_1f1b_runtime_compile``
the same order through torch's action runtime, which posts receives ahead), ``gb_pp2_auto_compile`` the
strategy's default pipeline for that batch, ``gb_tp2_compile_batch`` tp2 accumulating 16 sequences per
micro-batch. Their steps (warm-up, window, the profiled one) are optimizer steps; each row adds
``accumulate_grad_batches``, ``micro_batch``, ``accumulation`` (ZeroStrategy's settled mode) and, like every
profiled row, the step breakdown of ``lightning_perf.perf.comm.step_breakdown`` (``compute_pct``,
``exposed_p2p_pct``, ``exposed_collectives_pct``, ``idle_pct`` of the profiled step: the rank computing
the least of it, ``step_breakdown_rank``; each rank's under ``step_breakdown_per_rank``); pipelines also
``bubble_trace`` (exposed P2P plus idle) beside ``bubble_theory`` and the bubble measured against
``gb_dp2_zero3_compile``.

Then llama-8b (does not fit one GPU with Adam: 16 bytes/parameter) under pp2 (1F1B with 4
microbatches, and ``llama8b_pp2_auto``: the default pipeline) and tp2 with full activation
checkpointing, 4 x 2048 tokens per step.

Per variant: ``--warmup`` steps, then a window of ``--steps`` steps timed by
``_timing.WallClockWindow`` (a device synchronisation and a barrier on every rank at both ends
only; rank 0's host clock between them), then one profiled step. Headline: ``tokens_per_s``,
the global batch's tokens over the window's wall time (the mean step, slow steps included), with
``step_ms_mean`` / ``_median`` / ``_p90`` / ``_max`` and the garbage collections and Dynamo
recompilations inside the window (per rank). Reported from it: MFU per GPU (causal attention
counted once, against 989 TFLOP/s dense bf16), exposed communication % (NCCL kernel time
overlapped by no compute kernel, over the mean step), the GPU compute-idle share of the mean
step (max over ranks), and for pipelines the measured bubble ``1 - t(dp2) / t(pp2)`` (same
global batch: a bubble-free pipeline would match dp2's step time) against the theory
``(p-1) / (s*m + p-1)``, plus throughput as a share of the bubble bound
``dp2 tokens/s * (1 - theory)``. Also: peak allocated memory since training started (max over
ranks) and the host time to issue one step (``host_step_s_median``: close to the step time means
the host, not the GPU, sets the pace, as with eager DTensor dispatch). The CUDA-event median step
of the earlier results stays beside them: ``step_s_median`` and every figure derived from it under
``*_median_step`` (``tokens_per_s_median_step``, ``vs_dp2_tokens_per_s_median_step``,
``bubble_measured_median_step``, ...).

Variants of one model share one spawned process group (started once, CUDA state freed
between variants); a failing variant is recorded in the JSON and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import gc
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import launch, read_ranks  # noqa: E402
from _timing import WallClockWindow, clear_graph_breaks, graph_breaks  # noqa: E402

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet

GPT_VARIANTS: dict[str, dict[str, Any]] = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "pp2_1f1b_m4": {"pp": 2, "schedule": "1f1b", "m": 4},
    "pp2_1f1b_m8": {"pp": 2, "schedule": "1f1b", "m": 8},
    "pp2_gpipe_m4": {"pp": 2, "schedule": "gpipe", "m": 4},
    "pp2_interleaved_1f1b_m4": {"pp": 2, "schedule": "interleaved_1f1b", "m": 4, "spr": 2},
    # the strategy's default: schedule, microbatches and stages per rank chosen from the batch and the model
    "pp2_auto": {"pp": 2, "auto": True},
    # compiled (first step compiles: covered by the warm-up steps)
    "dp2_compile": {"dp": 2, "compile": "default"},
    "tp2_compile": {"tp": 2, "compile": "default"},
    "tp2_async_compile": {"tp": 2, "compile": "default", "async_tp": True},
    # how Inductor orders the collectives in a compiled TP block (the default, "reorder", above)
    "tp2_compile_no_reorder": {"tp": 2, "compile": "default", "tp_overlap": "none"},
    "tp2_compile_reorder_peak_memory": {"tp": 2, "compile": "default", "tp_overlap": "reorder_peak_memory"},
    "tp2_compile_schedule": {"tp": 2, "compile": "default", "tp_overlap": "schedule"},
    "tp2_async_compile_no_reorder": {"tp": 2, "compile": "default", "async_tp": True, "tp_overlap": "none"},
    # the residual stream sharded along the batch: collectives on the leading dim, no re-layout copies
    "tp2_compile_batch": {"tp": 2, "compile": "default", "sp": "batch"},
    "tp2_async_compile_batch": {"tp": 2, "compile": "default", "async_tp": True, "sp": "batch"},
    # each compiled block runs two halves of its batch: one half's collectives under the other's compute
    "tp2_compile_batch_split": {"tp": 2, "compile": "default", "sp": "batch", "tp_split": 2},
    "tp2_compile_batch_split_schedule": {"tp": 2, "compile": "default", "sp": "batch", "tp_split": 2,
                                         "tp_overlap": "schedule"},
    # q, k and v from one matmul (GPTConfig(fused_qkv=True)): dp2 and tp2 both
    "dp2_compile_fused_qkv": {"dp": 2, "compile": "default", "fused_qkv": True},
    "tp2_compile_batch_fused_qkv": {"tp": 2, "compile": "default", "sp": "batch", "fused_qkv": True},
    "tp2_async_compile_batch_fused_qkv": {"tp": 2, "compile": "default", "async_tp": True, "sp": "batch",
                                          "fused_qkv": True},
    # ablation: only the attention / MLP sublayers compiled (norms and residual adds eager)
    "tp2_compile_sublayer": {"tp": 2, "compile": "default", "tp_compile_scope": "sublayer"},
    "tp2_async_compile_sublayer": {"tp": 2, "compile": "default", "async_tp": True, "tp_compile_scope": "sublayer"},
    "pp2_1f1b_m4_compile": {"pp": 2, "schedule": "1f1b", "m": 4, "compile": "default"},
    "pp2_auto_compile": {"pp": 2, "auto": True, "compile": "default"},
    # FP8 linears (GPTConfig(fp8=True)): per-shard FP8 matmuls under TP, FP8 weight gathers under dp
    "dp2_compile_fp8": {"dp": 2, "compile": "default", "fp8": True, "fp8_all_gather": True},
    "tp2_compile_batch_fp8": {"tp": 2, "compile": "default", "sp": "batch", "fp8": True},
    "pp2_1f1b_m4_compile_fp8": {"pp": 2, "schedule": "1f1b", "m": 4, "compile": "default", "fp8": True},
    # Python's garbage collector on a fixed schedule on every rank (GarbageCollection every 10 steps)
    "dp2_compile_gc": {"dp": 2, "compile": "default", "gc": 10},
    "tp2_compile_batch_gc": {"tp": 2, "compile": "default", "sp": "batch", "gc": 10},
}
LLAMA_VARIANTS: dict[str, dict[str, Any]] = {
    "llama8b_pp2": {"pp": 2, "schedule": "1f1b", "m": 4, "ac": "full"},
    "llama8b_pp2_auto": {"pp": 2, "auto": True, "ac": "full"},
    "llama8b_tp2": {"tp": 2, "ac": "full"},
}

#: the global-batch variants' default optimizer step, in tokens per GPU (``--global-batch-tokens`` defaults to
#: this times ``--gpus``: 524,288 tokens on two GPUs). A real run steps on about a million tokens: a pipeline then
#: cuts each replica's batch into tens of microbatches and ZeRO accumulates micro-batches, so the layouts are
#: compared there rather than at the 16 sequences above, where a pipeline has 4 microbatches and its bubble decides.
GLOBAL_TOKENS_PER_GPU = 262144
#: the smoke run's global batch for the global-batch variants: 16 sequences of its 32 tokens
SMOKE_GLOBAL_TOKENS = 16 * 32

# Every layout at the same global batch in tokens (``--global-batch-tokens``). ``micro``: sequences per forward (a
# ZeRO / TP micro-batch per data-parallel rank, accumulated to the global batch; a pipeline's microbatch, the
# replica's whole batch being one Lightning batch cut into microbatches). A smoke run divides ``micro`` by 4.
GLOBAL_BATCH_VARIANTS: dict[str, dict[str, Any]] = {
    # ZeroStrategy(stage=3, accumulation="auto"): the memory planner picks gather_once / reduce_once / reduce_each
    "gb_dp2_zero3_compile": {"strategy": "zero", "zero": 3, "micro": 8, "compile": "default"},
    # Parallel3DStrategy's data-parallel path (ZeRO-2): gradients reduce-scattered once per optimizer step
    "gb_dp2_zero2_compile": {"dp": 2, "zero": 2, "micro": 8, "compile": "default"},
    # microbatches of 4 sequences (8192 tokens, the "auto" floor): 64 of them on two GPUs at the default batch
    "gb_pp2_1f1b_compile": {"pp": 2, "schedule": "1f1b", "micro": 4, "compile": "default"},
    # the same 1F1B order run by torch's action runtime (the interleaved schedule on one stage per rank), which
    # posts each receive ahead of the compute that needs it: torch's single-stage 1F1B posts it just before
    "gb_pp2_1f1b_runtime_compile": {"pp": 2, "schedule": "interleaved_1f1b", "spr": 1, "micro": 4,
                                    "compile": "default"},
    "gb_pp2_auto_compile": {"pp": 2, "auto": True, "compile": "default"},
    "gb_tp2_compile_batch": {"tp": 2, "micro": 16, "compile": "default", "sp": "batch"},
}


def global_batch_layout(spec: dict[str, Any], world: int, global_tokens: int, seq_len: int,
                        smoke: bool = False) -> dict[str, Any]:
    """How a global-batch variant reaches ``global_tokens`` per optimizer step on ``world`` GPUs.

    Returns ``batch`` (sequences per Lightning batch per data-parallel rank), ``accumulate`` (Lightning
    micro-batches per optimizer step) and ``microbatches`` (a pipeline's, ``None`` where "auto" chooses or
    there is no pipeline). Raises ``ValueError`` where the numbers do not divide.
    """
    pp, tp = spec.get("pp", 1), spec.get("tp", 1)
    dp = world // (pp * tp)
    if global_tokens % seq_len:
        raise ValueError(f"--global-batch-tokens {global_tokens} is not a whole number of {seq_len}-token sequences")
    per_replica, left = divmod(global_tokens // seq_len, dp)
    if left or per_replica == 0:
        raise ValueError(f"{global_tokens // seq_len} sequences do not split over {dp} data-parallel replicas")
    micro = spec.get("micro")
    if micro is not None and smoke:  # a batch-sharded TP micro-batch keeps a sequence per TP rank
        micro = max(tp if spec.get("sp") == "batch" else 1, micro // 4)
    if pp > 1:  # one Lightning batch per step, cut into the pipeline's microbatches
        if spec.get("auto"):
            return {"batch": per_replica, "accumulate": 1, "microbatches": None}
        if per_replica % micro:
            raise ValueError(f"{per_replica} sequences per replica do not cut into microbatches of {micro}")
        return {"batch": per_replica, "accumulate": 1, "microbatches": per_replica // micro}
    if per_replica % micro:
        raise ValueError(f"{per_replica} sequences per replica are no whole number of micro-batches of {micro}")
    return {"batch": micro, "accumulate": per_replica // micro, "microbatches": None}


def select(names: list[str], only: Optional[str]) -> list[str]:
    """``names`` matching any of the comma-separated shell patterns in ``only`` (all when None)."""
    import fnmatch

    if not only:
        return list(names)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _gc_callbacks(spec: dict) -> list:
    """``spec["gc"] = N``: Python's garbage collector every N steps on every rank (GarbageCollection)."""
    if not spec.get("gc"):
        return []
    from lightning_perf.callbacks import GarbageCollection

    return [GarbageCollection(every_n_steps=int(spec["gc"]))]


def _strategy(spec: dict[str, Any], world: int, compile_backend: str = "inductor",
              min_microbatch_tokens: Optional[int] = None) -> Any:
    """``spec["auto"]``: the pipeline's schedule, microbatches and stages per rank left to the strategy
    ("auto"), with ``min_microbatch_tokens`` (``None``: the strategy's default)."""
    from lightning_perf.parallel.model_parallel.pipeline import AUTO, MIN_MICROBATCH_TOKENS
    from lightning_perf.strategies import Parallel3DStrategy

    if spec.get("strategy") == "lightning_fsdp":  # Lightning's own FSDPStrategy, FULL_SHARD per block
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_perf.models.gpt.model import Block

        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}, state_dict_type="sharded",
                            activation_checkpointing_policy={Block} if spec.get("ac", "none") != "none" else None)
    if spec.get("strategy") == "zero":  # the ZeRO strategy itself (compile: the module's, per block)
        from lightning_perf.strategies import ZeroStrategy

        return ZeroStrategy(stage=spec.get("zero", 3), accumulation=spec.get("accumulation", "auto"), init="meta",
                            fp8_all_gather=spec.get("fp8_all_gather", False))
    pp, tp = spec.get("pp", 1), spec.get("tp", 1)
    auto = spec.get("auto", False)
    return Parallel3DStrategy(
        data_parallel_size=world // (pp * tp),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        zero_stage=spec.get("zero", 2),
        pipeline_schedule=AUTO if auto else spec.get("schedule", "1f1b"),
        num_microbatches=AUTO if auto else spec.get("m"),
        stages_per_rank=AUTO if auto else spec.get("spr", 1),
        min_microbatch_tokens=min_microbatch_tokens or MIN_MICROBATCH_TOKENS,
        activation_checkpointing=spec.get("ac", "none"),
        meta_init=True,
        compile=spec.get("compile"),
        compile_backend=compile_backend,
        async_tensor_parallel=spec.get("async_tp", False),
        tp_overlap=spec.get("tp_overlap", "reorder"),
        sequence_parallel=spec.get("sp", True),
        tp_split=spec.get("tp_split", 1),
        fp8_all_gather=spec.get("fp8_all_gather", False),
    )


def _timer(warmup: int, steps: int, trace_dir: str) -> Any:
    import lightning as L

    cuda = torch.cuda.is_available()

    class Timer(L.Callback):
        """CUDA-event times of optimizer steps; the step after the timed ones is profiled (all its micro-batches)."""

        def __init__(self) -> None:
            self.marks: list[list[Any]] = []
            self.host: list[list[Any]] = []  # host time to issue each step (~ the step time: host-bound)
            self.prof: Any = None
            self.trace: Optional[list[dict]] = None

        def on_train_start(self, trainer, pl_module):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def _now(self) -> Any:
            if not cuda:
                return time.perf_counter()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        # one mark per optimizer step: at the start of its first micro-batch and the end of its last
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % trainer.accumulate_grad_batches:
                return
            if trainer.global_step == warmup + steps:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                self.prof = profile(activities=acts)
                self.prof.__enter__()
            self.marks.append([self._now(), None])
            self.host.append([time.perf_counter(), None])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % trainer.accumulate_grad_batches:
                return
            self.marks[-1][1] = self._now()
            self.host[-1][1] = time.perf_counter()
            if self.prof is not None:
                if cuda:
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                path = os.path.join(trace_dir, f"trace_rank{trainer.global_rank}.json")
                self.prof.export_chrome_trace(path)
                with open(path) as f:
                    self.trace = json.load(f).get("traceEvents", [])
                os.remove(path)
                self.prof = None

        def step_times(self) -> list[float]:
            if cuda:
                torch.cuda.synchronize()
                out = [a.elapsed_time(b) / 1e3 for a, b in self.marks if b is not None]
            else:
                out = [b - a for a, b in self.marks if b is not None]
            return out[warmup : warmup + steps]

        def profiled_step_s(self) -> Optional[float]:
            """The profiled step's own length (under the profiler, a little longer than the timed ones)."""
            if len(self.marks) <= warmup + steps or self.marks[warmup + steps][1] is None:
                return None
            a, b = self.marks[warmup + steps]
            if cuda:
                torch.cuda.synchronize()
                return a.elapsed_time(b) / 1e3
            return b - a

        def host_times(self) -> list[float]:
            return [b - a for a, b in self.host if b is not None][warmup : warmup + steps]

    return Timer()


def _idle_share(trace: list[dict], step_s: float) -> Optional[float]:
    """Share of the profiled step in which no compute kernel runs on the GPU (bubble + waits)."""
    from lightning_perf.perf.intervals import total, union

    kernels = [e for e in trace if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return None
    compute = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in kernels if "nccl" not in e["name"].lower()]
    busy = total(union(compute))
    return max(0.0, 1.0 - busy / step_s)


def _collective_census() -> Any:
    """An Inductor post-grad pass (it runs after the async-TP pass) counting, per compiled graph,
    the collectives left plain and those fused into matmuls; caches off so every graph is seen."""
    from collections import Counter

    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    kinds = {"fused_all_gather_matmul": "fused_all_gather", "fused_matmul_reduce_scatter": "fused_reduce_scatter",
             "all_gather_into_tensor": "plain_all_gather", "reduce_scatter_tensor": "plain_reduce_scatter"}

    class Census(CustomGraphPass):
        def __init__(self) -> None:
            self.counts: Counter = Counter()

        def __call__(self, graph: Any) -> None:
            for node in graph.nodes:
                target = str(node.target)
                for needle, kind in kinds.items():
                    if needle in target:
                        self.counts[kind] += 1
                        break

        def uuid(self) -> Any:
            return None  # never cached

    census = Census()
    inductor_config.post_grad_custom_post_pass = census
    inductor_config.fx_graph_cache = False
    return census


from lightning_perf.parallel.compute.compile import compile_targets as _COMPILE_TARGETS  # noqa: E402


def _datamodule(loader: Any, batch_size: int, seq_len: int) -> Any:
    """A data module of ``loader`` that states its ``batch_size`` (per replica) and ``seq_len``, as
    ``TokenDataModule`` does: the strategy then knows the batch shape before it splits the model."""
    import lightning as L

    class Batches(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.seq_len = batch_size, seq_len

        def train_dataloader(self) -> Any:
            return loader

    return Batches()


def _run_one(name: str, spec: dict, args: dict, world: int, rank: int, trace_dir: str) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    from lightning_perf.models.gpt import GPTConfig
    from lightning_perf.models.gpt.module import GPTLightningModule

    smoke = args["smoke"]
    preset = spec.get("preset", args["preset"])
    T = spec.get("seq_len", args["seq_len"]) if not smoke else args["seq_len"]
    global_batch = spec.get("global_batch", args["global_batch"])
    dp = world // (spec.get("pp", 1) * spec.get("tp", 1))
    B, accumulate = global_batch // dp, 1
    layout = None
    if spec.get("global_tokens"):  # a global-batch variant: micro-batches accumulated, or a pipeline's microbatches
        layout = global_batch_layout(spec, world, spec["global_tokens"], T, smoke)
        B, accumulate = layout["batch"], layout["accumulate"]
        global_batch = B * dp * accumulate
        if layout["microbatches"] is not None:
            spec = dict(spec, m=layout["microbatches"])
    small = "tiny-llama" if "llama" in preset else "tiny"
    config = GPTConfig.from_name(small if smoke else preset, block_size=max(T, 16), tie_embeddings=False,
                                 fused_qkv=spec.get("fused_qkv", False), fp8=spec.get("fp8", False),
                                 kernels=spec.get("kernels", "torch"), attention=spec.get("attention", "sdpa"),
                                 **(spec.get("smoke_config", {}) if smoke else {}))  # e.g. heads for tp8
    pool = torch.randint(0, config.vocab_size, (64, T + 1), generator=torch.Generator().manual_seed(rank))

    class Tokens(Dataset):  # random tokens from a small pool: no data cost inside the step
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int):
            x = pool[i % len(pool)]
            return x[:-1], x[1:]

    L.seed_everything(0, verbose=False)
    import lightning_perf.parallel.compute.compile as pc

    pc.compile_targets = _COMPILE_TARGETS  # variants run one after another in this process
    if spec.get("tp_compile_scope") == "sublayer":
        pc.compile_targets = lambda block, tensor_parallel: (
            pc.tp_sublayers(block) if tensor_parallel else [block])
    if torch.cuda.is_available():  # async TP switches an Inductor flag for the process: reset it
        from torch._inductor import config as inductor_config

        inductor_config._micro_pipeline_tp = False
    census = (_collective_census() if spec.get("compile") and spec.get("tp", 1) > 1 and args["compile_backend"] == "inductor"
              else None)
    # the ZeRO strategy compiles and checkpoints nothing itself: the module does, per block (compiled by inductor;
    # eager on the CPU smoke run)
    zero = spec.get("strategy") == "zero"
    module = GPTLightningModule(config, warmup_steps=0, compile=spec.get("compile") if zero and not smoke else None,
                                activation_checkpointing=spec.get("ac", "none") if zero else "none")
    timer = _timer(args["warmup"], args["steps"], trace_dir)
    window = WallClockWindow(warmup=args["warmup"], steps=args["steps"], checkpoint=False)
    # the smoke run's tiny batch: the microbatch floor scaled by its sequence length (the GPU runs' 2048)
    floor = None
    if smoke:
        from lightning_perf.parallel.model_parallel.pipeline import MIN_MICROBATCH_TOKENS

        floor = max(1, MIN_MICROBATCH_TOKENS * T // 2048)
    strategy = _strategy(spec, world, args["compile_backend"], min_microbatch_tokens=floor)
    trainer = L.Trainer(
        accelerator="cpu" if smoke else "gpu", devices=world, strategy=strategy,
        precision="32-true" if smoke else "bf16-mixed", max_steps=args["warmup"] + args["steps"] + 1,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, window] + _gc_callbacks(spec),
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=_datamodule(DataLoader(Tokens(), batch_size=B, pin_memory=not smoke), B, T))
    times = timer.step_times()
    step = statistics.median(times)
    tokens_per_s_median_step = global_batch * T / step
    # the headline: this rank's window (opened and closed together on every rank), tokens of all replicas
    out: dict[str, Any] = dict(window.result)
    tokens_per_s, mean_step = out["tokens_per_s"], out["step_ms_mean"] / 1e3
    if torch.cuda.is_available():  # since training started, as before the window reset the counter
        out["peak_mem_gb_window"] = out["peak_mem_gb"]
        out["peak_mem_gb"] = max(torch.cuda.max_memory_allocated() / 1e9, out["peak_mem_gb_before_window"])
    out.update({
        "ok": True, "rank": rank, "preset": config.name, "world": world, "dp": dp, "tp": spec.get("tp", 1),
        "pp": spec.get("pp", 1), "schedule": spec.get("schedule"), "microbatches": spec.get("m"),
        "stages_per_rank": spec.get("spr", 1), "activation_checkpointing": spec.get("ac", "none"),
        "strategy": spec.get("strategy", "parallel3d"), "zero_stage": spec.get("zero", 2) if dp > 1 else None,
        "compile": spec.get("compile"), "async_tp": spec.get("async_tp", False),
        "tp_overlap": spec.get("tp_overlap", "reorder") if spec.get("tp", 1) > 1 else None,
        "sequence_parallel": spec.get("sp", True) if spec.get("tp", 1) > 1 else None,
        "fused_qkv": spec.get("fused_qkv", False), "fp8": spec.get("fp8", False),
        "fp8_all_gather": spec.get("fp8_all_gather", False),
        "tp_split": spec.get("tp_split", 1),
        "global_batch": global_batch, "seq_len": T, "global_batch_tokens": global_batch * T,
        "micro_batch": B, "accumulate_grad_batches": accumulate,
        "accumulation": getattr(trainer.strategy, "accumulation_mode", None),
        "step_s_median": step, "step_s_min": min(times),
        "step_s_max": max(times), "host_step_s_median": statistics.median(timer.host_times()),
        "tokens_per_s_median_step": tokens_per_s_median_step,
        "mfu": config.flops_per_token(T) * tokens_per_s / world / PEAK_BF16,
        "mfu_median_step": config.flops_per_token(T) * tokens_per_s_median_step / world / PEAK_BF16,
        "mfu_attention_twice": config.flops_per_token_full_attention(T) * tokens_per_s / world / PEAK_BF16,
        "fit_s": time.perf_counter() - t0,
    })
    choice = getattr(trainer.strategy, "pipeline_choice", None)
    if choice is not None:  # what the pipeline ran, chosen ("auto") or as set
        out.update(schedule=choice.schedule, microbatches=choice.num_microbatches,
                   stages_per_rank=choice.stages_per_rank, pipeline_choice=choice.as_dict(),
                   pipeline=choice.describe())
    if census is not None:  # what async TP managed to fuse (per compiled graph, forward and backward)
        out["collectives_in_compiled_graphs"] = dict(census.counts)
        from torch._inductor import config as inductor_config

        inductor_config.post_grad_custom_post_pass = None
    if timer.trace:
        from lightning_perf.perf.comm import analyze_comm_trace

        analysis = analyze_comm_trace(timer.trace, ranks=world)
        out["exposed_comm_pct"] = 100.0 * analysis.overlap.exposed / mean_step
        out["exposed_comm_pct_median_step"] = 100.0 * analysis.overlap.exposed / step
        # per collective kind in the profiled step: count, bytes, kernel seconds, bus bandwidth
        out["collectives"] = {k: vars(v) for k, v in analysis.collectives.items()}
        out["comm_s_per_step"] = analysis.overlap.comm  # the trace holds one step
        from lightning_perf.perf.gpu_time import gpu_time_breakdown

        out["gpu_time"] = gpu_time_breakdown(timer.trace, steps=1, top=40)
        from lightning_perf.perf.comm import step_breakdown

        # where the profiled step goes: compute, P2P waits (a pipeline's bubble, mostly), other collectives, nothing
        breakdown = step_breakdown(timer.trace, step_s=timer.profiled_step_s() or mean_step).as_dict()
        out["step_breakdown"] = breakdown
        out.update({key: breakdown[key] for key in ("compute_pct", "exposed_p2p_pct", "exposed_collectives_pct",
                                                    "idle_pct")})
        idle, idle_median = _idle_share(timer.trace, mean_step), _idle_share(timer.trace, step)
        out["compute_idle_pct"] = None if idle is None else 100.0 * idle
        out["compute_idle_pct_median_step"] = None if idle_median is None else 100.0 * idle_median
    del trainer, module, timer, window
    return out


def _worker(rank: int, world: int, port: int, names: list[str], specs: dict, args: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    for name in names:
        clear_graph_breaks()  # Dynamo's tally, per variant
        try:
            result = _run_one(name, specs[name], args, world, rank, out_dir)
        except BaseException as e:  # recorded, never fatal for the whole run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:],
                      "traceback": traceback.format_exc()[-4000:]}
        result["variant"] = name
        result.update(graph_breaks())
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
        torch._dynamo.reset()  # each variant compiles its own graphs (no cache-limit carry-over)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_group(names: list[str], specs: dict, args: dict, world: int, timeout: float) -> list[dict]:
    """One process group runs ``names`` in order; per variant, ranks' results are merged (:func:`merge_ranks`)."""
    tmp = tempfile.mkdtemp(prefix="bench3d_")
    error = launch(_worker, (names, specs, args, tmp), world, timeout)
    if error and error.startswith("timed out"):
        error = "group " + error
    return [merge_ranks(name, read_ranks(lambda r: os.path.join(tmp, f"{name}.rank{r}.json"), world), error)
            for name in names]


def merge_ranks(name: str, ranks: list[dict], error: str | None) -> dict:
    """One row from a variant's rank results: rank 0's window (the headline; a failed rank's error
    first), memory, exposed communication and idle share at their maximum over ranks, and per rank
    what explains a slow window."""
    if not ranks:
        return {"variant": name, "ok": False, "error": error or "no result"}
    res = dict(next((x for x in ranks if not x.get("ok")), ranks[0]))
    for key in ("peak_mem_gb", "exposed_comm_pct", "compute_idle_pct", "exposed_comm_pct_median_step",
                "compute_idle_pct_median_step"):
        vals = [x[key] for x in ranks if x.get(key) is not None]
        if vals:
            res[key] = max(vals)
    profiled = [x for x in ranks if x.get("step_breakdown")]
    if profiled:  # the step breakdown of the rank that computes the smallest share of its step
        slowest = min(profiled, key=lambda x: x["compute_pct"])
        res.update({key: slowest[key] for key in ("compute_pct", "exposed_p2p_pct", "exposed_collectives_pct",
                                                  "idle_pct")})
        res["step_breakdown_rank"] = slowest["rank"]
        res["step_breakdown_per_rank"] = [x.get("step_breakdown") for x in ranks]
    for key in ("gc_count_in_window", "gc_ms_in_window", "recompiles_in_window"):
        if any(key in x for x in ranks):
            res[f"{key}_per_rank"] = [x.get(key) for x in ranks]
    return res


def add_bubble_figures(results: list[dict]) -> None:
    """Throughput vs dp2 and, for pipelines, measured bubble against theory, same global batch: from
    the wall-clock mean step, and under ``*_median_step`` from the median step.

    The baseline is dp2 in the same mode: ``dp2_compile_fp8`` for an FP8 variant and ``dp2_compile``
    for a compiled one (when they ran), ``dp2`` otherwise (named in ``baseline``); ``vs_dp2_eager``
    compares with eager dp2 at the same batch. A global-batch variant (``gb_*``) is compared with ZeRO-3
    data parallelism at its batch (``gb_dp2_zero3_compile``, else ``gb_dp2_zero2_compile``). A pipeline
    also gets ``bubble_trace``: the largest share of its profiled step in which a rank computes nothing
    (exposed P2P plus idle, :func:`lightning_perf.perf.comm.step_breakdown`).
    """
    from lightning_perf.parallel.model_parallel.pipeline import bubble_fraction

    ok = {r["variant"]: r for r in results if r.get("ok")}
    eager = ok.get("dp2")

    def same_step(a: dict, b: dict) -> bool:  # the same model and tokens per optimizer step
        return all(a.get(k) == b.get(k) for k in ("preset", "global_batch", "seq_len"))

    for r in results:
        if not r.get("ok"):
            continue
        if r.get("pp", 1) > 1:
            r["bubble_theory"] = bubble_fraction(r["pp"], r["microbatches"], r["stages_per_rank"])
            # from the profiled step itself: the largest share over ranks in which a rank computes nothing and
            # waits on a send / recv or on nothing at all
            shares = [b["exposed_p2p_pct"] + b["idle_pct"] for b in r.get("step_breakdown_per_rank") or [] if b]
            if shares:
                r["bubble_trace"] = max(shares) / 100.0
        if r["variant"].startswith("gb_"):  # the global-batch layouts against ZeRO data parallelism at that batch
            base = ok.get("gb_dp2_zero3_compile") or ok.get("gb_dp2_zero2_compile")
        else:
            base = ok.get("dp2_compile") if r.get("compile") and "dp2_compile" in ok else eager
        if r.get("fp8") and "dp2_compile_fp8" in ok:  # FP8 layouts against FP8 dp2
            base = ok["dp2_compile_fp8"]
        if base is None or not same_step(r, base):
            continue
        r["baseline"] = base["variant"]
        for suffix in ("", "_median_step"):
            tokens_per_s = f"tokens_per_s{suffix}"
            r[f"vs_dp2_tokens_per_s{suffix}"] = r[tokens_per_s] / base[tokens_per_s]
            if eager is not None and same_step(r, eager):
                r[f"vs_dp2_eager{suffix}"] = r[tokens_per_s] / eager[tokens_per_s]
            if r.get("pp", 1) > 1:
                theory = r["bubble_theory"]
                # the same tokens per step in every layout: the step-time ratio is the throughput ratio
                r[f"bubble_measured{suffix}"] = 1.0 - r[tokens_per_s] / base[tokens_per_s]
                r[f"share_of_bubble_bound{suffix}"] = r[tokens_per_s] / (base[tokens_per_s] * (1.0 - theory))


def print_step_breakdown(results: list[dict]) -> None:
    """Per profiled row: where the step goes (compute, exposed P2P, exposed collectives, idle; the busiest-idle
    rank's), the median and p90 step, and sequences per forward x micro-batches per optimizer step."""
    rows = [r for r in results if r.get("ok") and r.get("compute_pct") is not None]
    if not rows:
        return
    print(f"\n{'step (slowest rank)':30s} {'compute':>8s} {'exp.P2P':>8s} {'exp.coll':>8s} {'idle':>6s} "
          f"{'median ms':>9s} {'p90 ms':>8s} {'micro x acc':>11s} {'bubble trace/th.':>16s}")
    for r in rows:
        shape = f"{r.get('micro_batch')}x{r.get('accumulate_grad_batches', 1)}"
        bubble = (f"{100 * r['bubble_trace']:.1f}%/{100 * r['bubble_theory']:.1f}%"
                  if r.get("bubble_trace") is not None and r.get("bubble_theory") is not None else "-")
        print(f"{r['variant']:30s} {r['compute_pct']:7.1f}% {r['exposed_p2p_pct']:7.1f}% "
              f"{r['exposed_collectives_pct']:7.1f}% {r['idle_pct']:5.1f}% {r['step_ms_median']:9.1f} "
              f"{r['step_ms_p90']:8.1f} {shape:>11s} {bubble:>16s}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on 2 CPU processes (gloo)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--preset", default="gpt-1.3b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=450.0, help="seconds for the gpt-1.3b group")
    parser.add_argument("--llama-timeout", type=float, default=120.0, help="seconds for the llama-8b group")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--only", default=None,
                        help="comma-separated variant patterns, e.g. 'dp2,tp2*,pp2_1f1b_m4*' (default: all)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend of the _compile variants (default inductor; aot_eager with --smoke)")
    parser.add_argument("--global-batch-tokens", nargs="?", type=int, const=0, default=None, metavar="N",
                        help="run the global-batch variants (gb_*) at N tokens per optimizer step (no N: "
                             f"{GLOBAL_TOKENS_PER_GPU} per GPU; --smoke: {SMOKE_GLOBAL_TOKENS}); --only 'gb_*' "
                             "selects them too, at that default")
    a = parser.parse_args(argv)
    if a.smoke:
        a.seq_len, a.global_batch, a.warmup, a.steps = 32, 8, 1, 2
    backend = a.compile_backend or ("aot_eager" if a.smoke else "inductor")
    args = {"smoke": a.smoke, "preset": a.preset, "seq_len": a.seq_len, "global_batch": a.global_batch,
            "warmup": a.warmup, "steps": a.steps, "compile_backend": backend}
    llama = {k: dict(v, preset="llama-8b", global_batch=4 if not a.smoke else 8) for k, v in LLAMA_VARIANTS.items()}
    tokens = a.global_batch_tokens or (SMOKE_GLOBAL_TOKENS if a.smoke else GLOBAL_TOKENS_PER_GPU * a.gpus)
    global_batch = {k: dict(v, global_tokens=tokens) for k, v in GLOBAL_BATCH_VARIANTS.items()}
    start = time.perf_counter()
    gpt_names, llama_names = select(list(GPT_VARIANTS), a.only), select(list(llama), a.only)
    # the global-batch variants run where asked for: --global-batch-tokens, or --only naming them
    gb_names = select(list(global_batch), a.only if a.only else None) if (a.global_batch_tokens is not None or a.only) \
        else []
    if a.global_batch_tokens is not None and not a.only:
        gpt_names, llama_names = [], []
    if not gpt_names and not gb_names and not (llama_names and not a.no_llama):
        parser.error(f"--only {a.only!r} matches no variant of {list(GPT_VARIANTS) + list(global_batch) + list(llama)}")
    if gb_names:  # the layouts check the numbers before any process starts
        for name in gb_names:
            try:
                global_batch_layout(global_batch[name], a.gpus, tokens, a.seq_len, a.smoke)
            except ValueError as e:
                parser.error(f"{name}: {e}")
    results = run_group(gpt_names, GPT_VARIANTS, args, a.gpus, a.timeout) if gpt_names else []
    if gb_names:
        results += run_group(gb_names, global_batch, args, a.gpus, a.timeout)
    if llama_names and not a.no_llama:
        results += run_group(llama_names, llama, args, a.gpus, a.llama_timeout)
    add_bubble_figures(results)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = {
        "benchmark": "bench_parallel3d",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpus": a.gpus,
        "torch": torch.__version__,
        "triton": triton_version,
        "config": {**args, "variants": {**GPT_VARIANTS, **global_batch, **llama}, "peak_flops": PEAK_BF16,
                   "only": a.only, "global_batch_tokens": tokens if gb_names else None,
                   "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")},
        "headline": "tokens / wall-clock seconds over the timed window (mean step), rank 0's clock",
        "wall_s": time.perf_counter() - start,
        "results": results,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"bench_parallel3d{'_smoke' if a.smoke else ''}_{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    head = f"{'variant':28s} {'tok/s':>9s} {'MFU':>6s} {'memGB':>6s} {'exp.comm':>8s} {'idle':>6s} " \
           f"{'vs dp2':>7s} {'bubble':>13s} {'of bound':>8s}"
    print("\n" + head)
    for r in results:
        if not r.get("ok"):
            print(f"{r['variant']:28s} failed: {r.get('error', '')[:90]}")
            continue

        def pct(key: str) -> str:
            return f"{r[key]:.1f}%" if r.get(key) is not None else "-"

        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        vs = f"{r['vs_dp2_tokens_per_s']:.2f}x" if r.get("vs_dp2_tokens_per_s") is not None else "-"
        measured = f"{100 * r['bubble_measured']:.0f}%" if r.get("bubble_measured") is not None else "-"
        bub = f"{measured}/{100 * r['bubble_theory']:.0f}%" if r.get("bubble_theory") is not None else "-"
        bound = f"{100 * r['share_of_bubble_bound']:.0f}%" if r.get("share_of_bubble_bound") is not None else "-"
        print(f"{r['variant']:28s} {r['tokens_per_s']:9.0f} {100 * r['mfu']:5.1f}% {mem:>6s} "
              f"{pct('exposed_comm_pct'):>8s} {pct('compute_idle_pct'):>6s} {vs:>7s} {bub:>13s} {bound:>8s}")
    for r in results:
        if r.get("ok") and r.get("pipeline_choice", {}).get("auto"):
            print(f"{r['variant']:28s} {r['pipeline']}")
    print_step_breakdown(results)
    print("vs dp2 and bubble: against dp2 in the same mode (dp2_compile for *_compile variants)")
    print("bubble = measured (1 - t_dp2 / t_pp) / theory (p-1)/(s*m+p-1); gb_* rows against gb_dp2_zero3_compile")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
