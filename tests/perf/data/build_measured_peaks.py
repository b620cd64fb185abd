"""Builds ``measured_peaks.json``: every recorded peak GPU memory figure of the benchmark results, one entry
per measured configuration, with what the benchmark scripts (at the commit that added the result) configured.

    PYTHONPATH=$PWD /work/main/.venv/bin/python tests/perf/data/build_measured_peaks.py

Every measured number is read from its result file at build time (nothing measured is written here); the
configuration of each variant is what the script that wrote the file builds for it, as read from the script
at that commit (see README.md beside this file). A field that the files and scripts do not settle is
``null``, with the reason in the entry's ``notes``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).resolve().parent / "measured_peaks.json"
QUOTES = Path(__file__).resolve().parent / "results_md_quotes.json"
RESULTS = "benchmarks/results"
SHARED = "/work/shared/measured/2026-11-27-h100"
GIB = 2**30

sys.path.insert(0, str(ROOT))
from lightning_perf.models.gpt.config import GPTConfig  # noqa: E402

# ---- reading sources ---------------------------------------------------------------------------------------


def _path(path: str) -> Path:
    return Path(path) if path.startswith("/") else ROOT / path


def load(path: str) -> Any:
    return json.loads(_path(path).read_text())


def pointer(doc: Any, key: str) -> Any:
    """The value at a JSON pointer (RFC 6901) inside ``doc``."""
    for part in key.lstrip("/").split("/") if key.strip("/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def device_of(name: str) -> str:
    for kind in ("H200", "H100"):
        if kind in name:
            return kind
    raise ValueError(f"unknown device {name!r}")


# ---- building blocks of an entry ----------------------------------------------------------------------------

PACK_GPT = "lightning_perf GPT in GPTLightningModule"
PLAIN_GPT = "lightning_perf GPT as a bare nn.Module in a plain PyTorch loop (benchmarks/_baselines.plain_training_loop)"
MP_GPT = "lightning_perf GPT in benchmarks/_baselines.ModelParallelGPT (PyTorch kernels, SDPA, no FP8, separate q/k/v)"

FP8_IMPLS = {
    None: None,
    # GPTConfig(fp8=True) from 2026-11-22 until torchao replaced it on 2026-11-24 (commit b2ac74c)
    "inhouse": "the in-house Float8Linear of 2026-11-22 (per-tensor dynamic scales, Triton amax/cast-transpose, "
               "torch._scaled_mm for forward, dgrad and wgrad)",
    "torchao": "torchao Float8Linear, torchao's matmul throughout (bf16/fp32 operands saved, cast again in backward)",
    "torchao+pack": "torchao Float8Linear layers with the pack's tensorwise matmul for plain weights (FP8 copies "
                    "saved for backward); torchao's matmul for FP8-gathered / tensor-parallel weights",
    "delayed": "DelayedFloat8Linear: the pack's matmul with scales from a 16-step amax history",
    "delayed+fused_gelu_mlp": "DelayedFloat8Linear with the fused delayed GELU MLP kernel "
                              "(kernels.float8.delayed_gelu_mlp) in each MLP",
}


def model(preset: str, *, model_class: str, fp8_impl: Optional[str] = None, **overrides: Any) -> dict[str, Any]:
    """The GPT the run trained: the preset with its overrides, every shape field resolved by GPTConfig."""
    cfg = GPTConfig.from_name(preset, **overrides)
    fp8 = cfg.fp8 or False
    if fp8 and fp8_impl is None:
        raise ValueError(f"{preset} {overrides}: FP8 without an implementation")
    return {
        "preset": preset, "model_class": model_class, "overrides": dict(sorted(overrides.items())),
        "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size, "block_size": cfg.block_size,
        "tie_embeddings": cfg.tie_embeddings, "norm": cfg.norm, "activation": cfg.activation,
        "positions": cfg.positions, "bias": cfg.bias, "kernels": cfg.kernels, "attention": cfg.attention,
        "fp8": fp8, "fp8_impl": FP8_IMPLS[fp8_impl] if fp8 else None, "fused_qkv": cfg.fused_qkv,
        "num_params": cfg.num_params(),
    }


ADAMW_MODULE = {"name": "AdamW", "fused": True, "param_groups": "weight decay on matrices only",
                "state_dtype": "float32", "state_device": "cuda", "master_weights": "float32"}
ADAMW_PLAIN_GPT = {"name": "AdamW", "fused": True, "param_groups": "one group (torch defaults)",
                   "state_dtype": "float32", "state_device": "cuda", "master_weights": "float32"}


def training(*, precision: str, mixed_precision: str, batch: int, seq_len: int, ac: str = "none",
             compile_mode: Optional[str] = None, compile_scope: Optional[str] = None, optimizer: dict,
             clip: Optional[float] = None, warmup: Optional[int] = None, timed: Optional[int] = None,
             global_batch: Optional[int] = None, microbatch: Optional[int] = None) -> dict[str, Any]:
    return {
        "precision": precision, "mixed_precision": mixed_precision,
        "micro_batch_per_gpu": batch, "pipeline_microbatch": microbatch, "global_batch": global_batch,
        "seq_len": seq_len, "accumulate_grad_batches": 1, "activation_checkpointing": ac,
        "compile": {"mode": compile_mode, "scope": compile_scope if compile_mode else None},
        "cuda_graphs": compile_mode == "reduce-overhead",
        "optimizer": optimizer, "gradient_clip_val": clip,
        "steps": {"warmup": warmup, "timed": timed},
    }


STRATEGY_KEYS = ("name", "family", "zero_stage", "sharding", "reshard_after_forward", "blocks_per_unit", "prefetch",
                 "fp8_all_gather", "param_dtype", "reduce_dtype", "offload", "init", "dp", "tp", "pp", "cp",
                 "pipeline_schedule", "microbatches", "stages_per_rank", "sequence_parallel", "async_tp", "tp_split",
                 "tp_overlap", "gradient_compression")


def strategy(name: str, family: str, **fields: Any) -> dict[str, Any]:
    unknown = set(fields) - set(STRATEGY_KEYS)
    if unknown:
        raise ValueError(f"unknown strategy fields {unknown}")
    out = {k: None for k in STRATEGY_KEYS}
    out.update(name=name, family=family, cp=1, **fields)
    return out


def single_device(name: str = "lightning SingleDeviceStrategy") -> dict[str, Any]:
    return strategy(name, "single-gpu", sharding="none", dp=1, tp=1, pp=1, param_dtype="autocast bf16, fp32 parameters")


PLAIN_LOOP = "none (plain PyTorch loop on one GPU)"


def zero(stage: int, world: int, *, blocks_per_unit: int = 1, prefetch: int = 1, fp8_all_gather: bool = False,
         reduce_dtype: str = "float32", init: str = "rank0", offload: Optional[str] = None,
         gradient_compression: Optional[str] = None) -> dict[str, Any]:
    fsdp = stage >= 2
    return strategy(
        "lightning_perf.strategies.ZeroStrategy", f"zero{stage}" + ("-offload" if offload else ""), zero_stage=stage,
        sharding=("FSDP2 fully_shard per block over the dp mesh" if fsdp
                  else "DDP (parameters and gradients replicated) + ZeroRedundancyOptimizer (optimizer state sharded)"),
        reshard_after_forward=stage == 3 if fsdp else None, blocks_per_unit=blocks_per_unit if fsdp else None,
        prefetch=prefetch if fsdp else None, fp8_all_gather=fp8_all_gather,
        param_dtype="bfloat16 (FSDP2 MixedPrecisionPolicy)" if fsdp else "autocast bf16, fp32 parameters",
        reduce_dtype=reduce_dtype if fsdp else "float32 (DDP all-reduce of fp32 gradients)", offload=offload,
        init=init, dp=world, tp=1, pp=1, gradient_compression=gradient_compression)


MP_ZERO = "FSDP2 (bf16 parameters, fp32 master shards and reduction, no autocast)"
AUTOCAST = "torch.autocast bf16 over fp32 parameters"


def measured(row: dict, *, allocated_from: list[str], ranks: str, scope: str, window: Optional[str] = None,
             before: Optional[str] = None, reserved: Optional[str] = None, reserved_ranks: Optional[str] = None,
             reserved_only: bool = False, categories: Optional[dict[str, str]] = None,
             extra: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The figures of ``row`` (a result object): ``allocated_from`` are the keys whose maximum is the run's
    allocated peak; ``window`` / ``before`` / ``reserved`` the keys of those figures where recorded."""
    values = [row[k] for k in allocated_from if row.get(k) is not None]
    fields = {}
    out: dict[str, Any] = {
        "peak_allocated_gb": max(values) if values else None, "allocated_from": allocated_from,
        "allocated_scope": scope, "allocated_ranks": ranks,
        "peak_allocated_gb_window": None, "peak_allocated_gb_before_window": None,
        "peak_reserved_gb": None, "reserved_ranks": None, "reserved_only": reserved_only,
        "compare_on": "reserved" if reserved_only else "allocated", "categories_gb": None, "extra_gb": None,
        "oom": None,
    }
    for field, key in (("peak_allocated_gb_window", window), ("peak_allocated_gb_before_window", before),
                       ("peak_reserved_gb", reserved)):
        if key and row.get(key) is not None:
            out[field] = row[key]
            fields[field] = key
    if out["peak_reserved_gb"] is not None:
        out["reserved_ranks"] = reserved_ranks or ranks
    if reserved_only and out["peak_reserved_gb"] is None:
        out["compare_on"] = "none"
    if categories:
        out["categories_gb"] = {name: row[key] for name, key in categories.items()}
        fields.update({f"categories_gb.{name}": key for name, key in categories.items()})
    if extra:
        out["extra_gb"] = {name: row[key] for name, key in extra.items()}
        fields.update({f"extra_gb.{name}": key for name, key in extra.items()})
    out["source_fields"] = fields
    return out


_OOM = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB)\. GPU (\d+) has a total capacity of ([\d.]+) GiB.*?"
                  r"Of the allocated memory ([\d.]+) GiB is allocated by PyTorch", re.S)


def oom_measured(message: str) -> dict[str, Any]:
    """An out-of-memory run: what PyTorch's message says was allocated, asked for and available."""
    m = _OOM.search(message)
    if m is None:
        raise ValueError(f"no CUDA out-of-memory figures in {message[:200]!r}")
    tried = float(m.group(1)) * (GIB if m.group(2) == "GiB" else 2**20)
    allocated = float(m.group(5)) * GIB
    return {
        "peak_allocated_gb": None, "allocated_from": [], "allocated_scope": None, "allocated_ranks": None,
        "peak_allocated_gb_window": None, "peak_allocated_gb_before_window": None, "peak_reserved_gb": None,
        "reserved_ranks": None, "reserved_only": False, "compare_on": "lower_bound", "categories_gb": None,
        "extra_gb": None, "source_fields": {},
        "oom": {"gpu": int(m.group(3)), "capacity_gib": float(m.group(4)),
                "allocated_by_pytorch_gib": float(m.group(5)), "tried_to_allocate_gb": round(tried / 1e9, 4),
                # the run needed at least what it held plus what it asked for when it failed
                "lower_bound_gb": round((allocated + tried) / 1e9, 4)},
    }


ENTRIES: list[dict[str, Any]] = []


def run_date(path: str) -> Optional[str]:
    """The run's date as its file records it (ISO), else the date in its name."""
    text = _path(path).read_text()
    if path.endswith(".json"):
        date = json.loads(text).get("date")
        if date:
            return str(date)[:19]
    m = re.search(r"_(20\d{6})", Path(path).name)
    return f"{m.group(1)[:4]}-{m.group(1)[4:6]}-{m.group(1)[6:]}" if m else None


def add(id: str, path: str, key: str, *, device_name: str, world: int, side: str, harness: dict, model: dict,
        training: dict, strategy: dict, measured: dict, results_md: Optional[str] = None,
        baseline: Optional[dict] = None, notes: tuple = (), kind: str = "json") -> None:
    id = re.sub(r"[^a-z0-9.]+", "-", id.lower()).strip("-")
    external = path.startswith("/")
    if not _path(path).is_file():
        raise FileNotFoundError(path)
    status = "oom" if measured["oom"] else "ok"
    ENTRIES.append({
        "id": id,
        "source": {"path": path, "key": key, "kind": kind, "external": external,
                   "fields": measured.pop("source_fields")},
        "date": run_date(path), "device": device_of(device_name), "device_name": device_name, "world_size": world,
        "status": status, "side": side, "baseline": baseline, "harness": harness, "model": model,
        "training": training, "strategy": strategy, "measured": measured, "results_md": results_md,
        "notes": list(notes),
    })


# ---- bench_parallel.py: ZeRO variants against Lightning's strategies ------------------------------------------

GC_NOTE = "garbage-collection settings (GarbageCollection / gc_every_n_steps) do not change what the GPU holds"
PARALLEL_RESET = ("bench_parallel: reset_peak_memory_stats() at on_train_start (after the model is sharded and "
                  "materialised), so the figure covers every step of the fit: warm-up, window and the script's "
                  "extra probe / profiled steps")


def parallel_spec(variant: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_parallel  # noqa: E402

    return dict(bench_parallel.VARIANTS[variant])


def parallel_strategy(spec: dict, world: int) -> tuple[dict, str, Optional[dict]]:
    """(strategy, mixed-precision policy, baseline description) of a bench_parallel variant, as build_strategy
    makes it."""
    reduce_dtype = "bfloat16" if spec.get("reduce_dtype") == "bf16" else "float32"
    if spec.get("baseline") == "model_parallel":
        s = strategy("lightning.pytorch.strategies.ModelParallelStrategy", "lightning-model-parallel", zero_stage=3,
                     sharding="FSDP2 fully_shard per block (after per-block torch.compile), root sharded last",
                     reshard_after_forward=True, blocks_per_unit=1, prefetch=None, fp8_all_gather=False,
                     param_dtype="bfloat16 (MixedPrecisionPolicy)", reduce_dtype="float32", init="meta", dp=world,
                     tp=1, pp=1)
        return s, "Trainer precision 32-true; FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), " \
                  "fp32 master shards, no autocast", {
            "name": "Lightning ModelParallelStrategy + FSDP2 + per-block compile",
            "model_class": MP_GPT, "sharding": "FSDP2 per block, reshard after forward (ZeRO-3)",
            "mixed_precision": "MixedPrecisionPolicy bf16 compute, fp32 master weights and gradient reduction"}
    if "zero" in spec:
        z = dict(spec["zero"])
        return zero(z.pop("stage"), world, reduce_dtype=reduce_dtype, **z), MP_ZERO, None
    name = spec["strategy"]
    if name == "ddp":
        s = strategy("lightning.pytorch.strategies.DDPStrategy", "lightning-ddp", zero_stage=0,
                     sharding="none (DDP replicas)", param_dtype="autocast bf16, fp32 parameters",
                     reduce_dtype="float32", dp=world, tp=1, pp=1)
        return s, AUTOCAST, {"name": "Lightning DDPStrategy", "model_class": PACK_GPT, "sharding": "none",
                             "mixed_precision": "Lightning bf16-mixed: autocast over fp32 parameters"}
    if name == "fsdp_full":
        s = strategy("lightning.pytorch.strategies.FSDPStrategy", "lightning-fsdp", zero_stage=3,
                     sharding="FSDP1 FULL_SHARD, auto_wrap_policy={Block} (one unit per block)",
                     reshard_after_forward=True, param_dtype="bfloat16 (FSDP1 MixedPrecision)",
                     reduce_dtype="bfloat16", init="Lightning default (materialised on device)", dp=world, tp=1, pp=1)
        return s, "Lightning FSDPPrecision bf16-mixed: FSDP1 MixedPrecision(param, reduce, buffer = bf16) with " \
                  "autocast, fp32 flat master shards", {
            "name": "Lightning FSDPStrategy FULL_SHARD", "model_class": PACK_GPT,
            "sharding": "FSDP1 FULL_SHARD, one unit per Block",
            "mixed_precision": "FSDP1 MixedPrecision param/reduce/buffer bf16 + autocast"}
    if name == "zero3_meta":
        return zero(3, world, init="meta"), MP_ZERO, None
    if name.endswith("_fp8_gather"):
        return zero(int(name[4]), world, fp8_all_gather=True, reduce_dtype=reduce_dtype), MP_ZERO, None
    if "_units" in name:
        stage, units = name.split("_units")
        return zero(int(stage[-1]), world, blocks_per_unit=int(units), reduce_dtype=reduce_dtype), MP_ZERO, None
    if name.startswith("zero3_prefetch"):
        return zero(3, world, prefetch=int(name[len("zero3_prefetch"):]), reduce_dtype=reduce_dtype), MP_ZERO, None
    stage = int(name[-1])
    return zero(stage, world, reduce_dtype=reduce_dtype), (MP_ZERO if stage >= 2 else AUTOCAST), None


def add_parallel(fname: str, *, fp8_impl: Optional[str], commit: str) -> None:
    path = f"{RESULTS}/{fname}"
    doc = load(path)
    new = "headline" in doc  # written by the wall-clock version (2026-11-25 on)
    for i, row in enumerate(doc["results"]):
        if not row.get("ok"):
            continue
        variant = row["variant"]
        spec = parallel_spec(variant)
        world, B, T = row["world"], row["batch_per_gpu"], row["seq_len"]
        strat, mp, baseline = parallel_strategy(spec, world)
        is_mp = spec.get("baseline") == "model_parallel"
        overrides: dict[str, Any] = {"block_size": max(T, 16)}
        for k in ("kernels", "attention"):
            if k in spec:
                overrides[k] = spec[k]
        if spec.get("fp8"):
            overrides["fp8"] = spec["fp8"]
        if spec.get("fused_qkv"):
            overrides["fused_qkv"] = True
        if is_mp:  # _baselines.plain_gpt_config
            overrides.update(kernels="torch", attention="sdpa", fp8=False, fused_qkv=False)
        impl = None
        if overrides.get("fp8"):
            impl = fp8_impl if not strat["fp8_all_gather"] else "torchao+pack"
        notes = [PARALLEL_RESET]
        if new:
            notes.append("peak_allocated_gb is the script's peak_mem_gb: max over ranks of max(the peak since the "
                         "window reset, the peak before it); the window, before-window and reserved figures are "
                         "rank 0's (merge_ranks keeps rank 0's row); reserved is since the window's reset (the "
                         "caching allocator's reserve carries over)")
        else:
            notes.append("peak_mem_gb: torch.cuda.max_memory_allocated() since on_train_start, max over ranks; "
                         "no reserved figure was recorded by this version of the script")
        if spec.get("gc") or "gc_every" in spec:
            notes.append(GC_NOTE)
        if spec.get("env"):
            notes.append(f"environment {spec['env']} (NCCL CTA limit: no memory effect expected)")
        if spec.get("numa"):
            notes.append("ranks bound to their GPU's NUMA node (benchmarks/_affinity.py)")
        if impl in ("inhouse",):
            notes.append("FP8 here is GPTConfig(fp8=True) of 2026-11-22: the in-house Float8Linear, later replaced "
                         "by torchao's; its memory is not what fp8='tensorwise' builds today")
        if strat["fp8_all_gather"]:
            notes.append("FP8 all-gather: weights quantised per shard and gathered in FP8 (torchao weight wrapper)")
        prec = "32-true" if is_mp else "bf16-mixed"
        add(f"parallel-{_tag(fname)}-{variant}", path, f"/results/{i}", device_name=doc["device"], world=world,
            side="baseline" if baseline else "pack",
            harness={"script": "benchmarks/bench_parallel.py", "variant": variant, "result_commit": commit,
                     "precision_plugin": ("PerfPrecision(reduce_dtype=bf16)" if spec.get("reduce_dtype")
                                          else f"Trainer(precision={prec!r})")},
            model=model(row["preset"], model_class=MP_GPT if is_mp else PACK_GPT, fp8_impl=impl, **overrides),
            training=training(precision=prec, mixed_precision=mp, batch=B, seq_len=T, ac=spec.get("ac", "none"),
                              compile_mode=None if not spec.get("compile") and not is_mp else "default",
                              compile_scope="block", optimizer=ADAMW_MODULE, clip=None,
                              warmup=spec.get("warmup", doc["config"]["warmup"]),
                              timed=spec.get("steps", doc["config"]["steps"]), global_batch=B * world),
            strategy=strat, baseline=baseline,
            measured=measured(row, allocated_from=["peak_mem_gb"], ranks="max_over_ranks",
                              scope="since on_train_start" if not new else "run (since on_train_start)",
                              window="peak_mem_gb_window" if new else None,
                              before="peak_mem_gb_before_window" if new else None,
                              reserved="peak_reserved_gb" if new else None, reserved_ranks="rank0"),
            notes=tuple(notes))


def _tag(fname: str) -> str:
    """``bench_parallel_2xh200_20261122_eager.json`` -> ``2xh200-20261122-eager``."""
    stem = Path(fname).stem
    for prefix in ("bench_parallel3d_", "bench_parallel_", "bench_recipes_", "bench_gpt_", "bench_8gpu_",
                   "bench_offload_", "bench_memory_", "bench_hf_import_"):
        if stem.startswith(prefix):
            stem = stem[len(prefix):]
            break
    return stem.replace("_", "-").replace("--", "-").lower()


# ---- bench_parallel3d.py / bench_8gpu.py: Parallel3DStrategy layouts ------------------------------------------


def add_3d(path: str, *, script: str, fp8_impl: Optional[str], commit: str,
           specs: Optional[dict] = None) -> None:
    doc = load(path)
    new = "headline" in doc
    if specs is None:
        specs = doc["config"]["variants"]
    args = doc["config"]
    for i, row in enumerate(doc["results"]):
        variant = row["variant"]
        spec = dict(specs[variant])
        world = row.get("world") or spec.get("world")
        if not row.get("ok"):
            if "out of memory" not in str(row.get("error", "")).lower():
                continue
            world = spec["world"]
        pp, tp = spec.get("pp", 1), spec.get("tp", 1)
        dp = world // (pp * tp)
        global_batch = spec.get("global_batch", args["global_batch"])
        B = global_batch // dp
        T = spec.get("seq_len", args["seq_len"])
        preset = spec.get("preset", args["preset"])
        lightning_fsdp = spec.get("strategy") == "lightning_fsdp"
        schedule = row.get("schedule", spec.get("schedule", "1f1b") if pp > 1 else None)
        m = row.get("microbatches", spec.get("m"))
        spr = row.get("stages_per_rank", spec.get("spr", 1))
        zero_stage = spec.get("zero", 2) if dp > 1 else None
        use_fsdp = dp > 1 and (zero_stage or 0) > 0
        notes = []
        if lightning_fsdp:
            strat = strategy("lightning.pytorch.strategies.FSDPStrategy", "lightning-fsdp", zero_stage=3,
                             sharding="FSDP1 FULL_SHARD, auto_wrap_policy={Block}", reshard_after_forward=True,
                             param_dtype="bfloat16 (FSDP1 MixedPrecision)", reduce_dtype="bfloat16", dp=world, tp=1,
                             pp=1)
            mp = "Lightning FSDPPrecision bf16-mixed: FSDP1 MixedPrecision(param, reduce, buffer = bf16) with autocast"
            baseline = {"name": "Lightning FSDPStrategy FULL_SHARD", "model_class": PACK_GPT,
                        "sharding": "FSDP1 FULL_SHARD, one unit per Block",
                        "mixed_precision": "FSDP1 MixedPrecision param/reduce/buffer bf16 + autocast"}
        else:
            family = "parallel3d-" + "x".join(f"{n}{v}" for n, v in (("pp", pp), ("tp", tp), ("dp", dp)) if v > 1) \
                if world > 1 else "parallel3d-dp1"
            reshard = "reshard after forward" if zero_stage == 3 and pp == 1 else "no reshard after forward"
            strat = strategy(
                "lightning_perf.strategies.Parallel3DStrategy", family, zero_stage=zero_stage,
                sharding=(f"FSDP2 per block over dp ({reshard})" if use_fsdp else "no data-parallel sharding")
                + (", TP DTensor shards" if tp > 1 else "") + (", pipeline stages" if pp > 1 else ""),
                reshard_after_forward=(zero_stage == 3 and pp == 1) if use_fsdp else None,
                blocks_per_unit=1 if use_fsdp else None, prefetch=1 if use_fsdp else None,
                fp8_all_gather=bool(spec.get("fp8_all_gather", False)),
                param_dtype="bfloat16 (FSDP2 MixedPrecisionPolicy)" if use_fsdp else "autocast bf16, fp32 parameters",
                reduce_dtype="float32" if use_fsdp else None, init="meta (meta_init=True)", dp=dp, tp=tp, pp=pp,
                pipeline_schedule=schedule if pp > 1 else None, microbatches=m if pp > 1 else None,
                stages_per_rank=spr if pp > 1 else None,
                sequence_parallel=spec.get("sp", True) if tp > 1 else None,
                async_tp=bool(spec.get("async_tp", False)) if tp > 1 else None,
                tp_split=spec.get("tp_split", 1) if tp > 1 else None,
                tp_overlap=spec.get("tp_overlap", "reorder") if tp > 1 and spec.get("compile") else None)
            mp = MP_ZERO if use_fsdp else AUTOCAST
            baseline = None
            if zero_stage == 1 and use_fsdp:
                notes.append("zero_stage=1 inside Parallel3DStrategy is FSDP2 without reshard after forward, the "
                             "same memory layout as zero_stage=2 (parallelize_3d: FSDP2 whenever zero_stage > 0; "
                             "reshard only at stage 3 without pipeline parallelism)")
            if pp > 1 and dp > 1 and zero_stage == 3:
                notes.append("under pipeline parallelism stage 3 keeps parameters gathered (no reshard)")
        if world == 1:
            notes.append("one GPU: no sharding (Parallel3DStrategy with dp=tp=pp=1)")
        fp8 = spec.get("fp8", False)
        impl = None
        if fp8:
            gathered = "torchao+pack" if fp8_impl != "inhouse" else "inhouse"
            impl = gathered if spec.get("fp8_all_gather") else fp8_impl
            if fp8_impl == "inhouse":
                notes.append("FP8 here is GPTConfig(fp8=True) of 2026-11-22 (the in-house Float8Linear, replaced by "
                             "torchao's on 2026-11-24)")
        if pp > 1:
            notes.append(f"pipeline microbatch = {B} // {m} sequences; peak is max over ranks (stages differ)")
        if spec.get("gc"):
            notes.append(GC_NOTE)
        if spec.get("tp_compile_scope"):
            notes.append(f"TP compile scope {spec['tp_compile_scope']}")
        overrides = dict(block_size=max(T, 16), tie_embeddings=False, fused_qkv=bool(spec.get("fused_qkv", False)),
                         kernels=spec.get("kernels", "torch"), attention=spec.get("attention", "sdpa"))
        if fp8:
            overrides["fp8"] = fp8
        if not overrides["fused_qkv"]:
            overrides.pop("fused_qkv")
        if not row.get("ok"):
            pass
        elif new:
            notes.append("peak_allocated_gb is the script's peak_mem_gb: max over ranks of max(peak since the window's "
                         "reset, peak before it), since on_train_start; the window, before-window and reserved "
                         "figures are rank 0's")
        else:
            notes.append("peak_mem_gb: torch.cuda.max_memory_allocated() since on_train_start (steps, then one "
                         "profiled step), max over ranks; no reserved figure recorded by this version")
        harness = {"script": script, "variant": variant, "result_commit": commit,
                   "precision_plugin": "Trainer(precision='bf16-mixed')"}
        scope = "block + the last stage's head and loss"
        if spec.get("compile") and doc["date"] < "2026-11-22T06:44":
            scope = "block"
        elif spec.get("compile") and doc["date"] < "2026-11-22T06:55":
            scope = None
            notes.append("compile scope not settled: the head + loss compile landed at 2026-11-22 06:44 (a852b71), "
                         "four minutes before this run; blocks were compiled either way")
        kw = dict(device_name=doc["device"], world=world, side="baseline" if baseline else "pack", harness=harness,
                  model=model(preset, model_class=PACK_GPT, fp8_impl=impl, **overrides),
                  training=training(precision="bf16-mixed", mixed_precision=mp, batch=B, seq_len=T,
                                    ac=spec.get("ac", "none"), compile_mode=spec.get("compile"),
                                    compile_scope=scope,
                                    optimizer=ADAMW_MODULE, warmup=args["warmup"], timed=args["steps"],
                                    global_batch=global_batch, microbatch=(B // m) if pp > 1 and m else None),
                  strategy=strat, baseline=baseline)
        prefix = "parallel3d" if script.endswith("bench_parallel3d.py") else "8gpu"
        if not row.get("ok"):
            msr = oom_measured(row["error"])
            msr["source_fields"] = {"oom.message": "error"}
            notes.append("out of memory: the run failed; oom.lower_bound_gb is what it held plus what it asked for")
            add(f"{prefix}-{_tag(Path(path).name)}-{variant}", path, f"/results/{i}", measured=msr,
                notes=tuple(notes), **kw)
            continue
        add(f"{prefix}-{_tag(Path(path).name)}-{variant}", path, f"/results/{i}",
            measured=measured(row, allocated_from=["peak_mem_gb"], ranks="max_over_ranks",
                              scope="since on_train_start", window="peak_mem_gb_window" if new else None,
                              before="peak_mem_gb_before_window" if new else None,
                              reserved="peak_reserved_gb" if new else None, reserved_ranks="rank0"),
            notes=tuple(notes), **kw)


def eight_gpu_specs(doc: dict) -> dict[str, dict]:
    """bench_8gpu records its groups as (part, group, world, {variant: spec})."""
    out = {}
    for _part, _group, world, specs in doc["config"]["groups"]:
        for name, spec in specs.items():
            out[name] = dict(spec, world=world)
    return out


# ---- bench_gpt.py: Trainer against the plain compiled loop, one GPU -----------------------------------------


def add_gpt(fname: str, *, fp8_impl: Optional[str], commit: str) -> None:
    path = f"{RESULTS}/{fname}"
    doc = load(path)
    new = "headline" in doc
    for i, row in enumerate(doc["runs"]):
        if "error" in row:
            continue
        variant, kernels = row["variant"], row["kernels"]
        extra = dict(row.get("config") or {})
        amax = extra.pop("amax", None)
        trainer = variant.startswith("trainer")
        overrides = dict(kernels=kernels, attention="auto" if kernels == "triton" else "sdpa", **extra)
        if overrides.get("fp8") is True:
            overrides["fp8"] = "tensorwise"
        impl = None
        if overrides.get("fp8"):
            impl = fp8_impl if overrides["fp8"] != "delayed" else "delayed"
        cg = row["compile"] == "reduce-overhead"
        notes = ["the variant's peak stats are reset (and the cache emptied) before it is built, so the figure "
                 "covers build, compile, warm-up and the window"]
        if new:
            notes.append("peak_allocated_gb = max(window peak, before-window peak), the script's peak_mem_gb")
        if cg:
            notes.append("CUDA graphs (reduce-overhead): replays draw on the graph pool, which the allocated peak "
                         "inside the window does not see; the whole-run allocated figure comes from warm-up and "
                         "capture, so only the reserved figure describes the replayed step")
            if not new:
                notes.append("no reserved figure was recorded by this version of the script: nothing here "
                             "describes the replayed step's footprint")
        if impl == "inhouse":
            notes.append("FP8 here is GPTConfig(fp8=True) of 2026-11-22 (the in-house Float8Linear)")
        if amax:
            notes.append(f"amax ablation: {amax}")
        base = None if trainer else {
            "name": "plain compiled loop", "model_class": PLAIN_GPT, "sharding": "none (one GPU)",
            "mixed_precision": "torch.autocast bf16 over fp32 parameters"}
        opt = ADAMW_MODULE if trainer else ADAMW_PLAIN_GPT
        add(f"gpt-{_tag(fname)}-{variant}", path, f"/runs/{i}", device_name=doc["device"], world=1,
            side="pack" if trainer else "baseline",
            harness={"script": "benchmarks/bench_gpt.py", "variant": variant, "result_commit": commit,
                     "precision_plugin": ("Trainer(precision='bf16-mixed')" if trainer
                                          else "none (autocast in the loop)")},
            model=model(row["model"], model_class=PACK_GPT if trainer else PLAIN_GPT, fp8_impl=impl, **overrides),
            training=training(precision="bf16-mixed", mixed_precision=AUTOCAST, batch=row["batch"],
                              seq_len=row["seq_len"], compile_mode=row["compile"], compile_scope=row["compile_scope"],
                              optimizer=opt, warmup=doc.get("warmup"), timed=row.get("steps_timed"),
                              global_batch=row["batch"]),
            strategy=single_device() if trainer else single_device(PLAIN_LOOP), baseline=base,
            measured=measured(row, allocated_from=["peak_mem_gb"], ranks="single_gpu",
                              scope="variant (reset before the model is built)",
                              window="peak_mem_gb_window" if new else None,
                              before="peak_mem_gb_before_window" if new else None,
                              reserved="peak_reserved_gb" if new else None, reserved_only=cg),
            notes=tuple(notes))


# ---- bench_recipes.py: recipes through lightning-perf fit against their baselines -------------------------------

RECIPE_NOTE = ("the recipe side's peak stats are reset when its window opens (after the warm-up steps): "
               "peak_mem_gb is the window's peak; peak_mem_gb_before_window (where recorded) covers setup and the "
               "warm-up; peak_allocated_gb is the larger of the two recorded")
PLAIN_NOTE = ("the plain loop's peak stats are reset when its window opens (after the warm-up steps); "
              "peak_allocated_gb is the larger of the window and before-window peaks where both are recorded")
CLI_PRECISION = "PerfPrecision bf16-mixed (the CLI's): autocast bf16 over fp32 parameters on one device"


def recipe_1gpu(name: str, fp8: Optional[str], compile_mode: str, *, kernels: str = "torch", attention: str = "sdpa",
                fused_qkv: bool = False) -> dict[str, Any]:
    """The single-GPU recipe as the YAML of the run's day set it."""
    shapes = {"gpt2-124m": ("gpt2-124m", 16, 1024), "gpt-1.3b": ("gpt-1.3b", 8, 2048),
              "gpt-1.3b-fp8": ("gpt-1.3b", 8, 2048)}
    preset, batch, T = shapes[name]
    return {"preset": preset, "batch": batch, "seq_len": T, "compile": compile_mode, "scope": "model",
            "kernels": kernels, "attention": attention, "fp8": fp8, "fused_qkv": fused_qkv}


def add_recipe_side(id: str, path: str, key: str, doc: dict, row: dict, rc: dict, *, fp8_impl: Optional[str],
                    variant: Optional[str], commit: str, notes: tuple = ()) -> None:
    overrides: dict[str, Any] = {"kernels": rc["kernels"], "attention": rc["attention"]}
    if rc["fp8"]:
        overrides["fp8"] = rc["fp8"]
    if rc["fused_qkv"]:
        overrides["fused_qkv"] = True
    cg = rc["compile"] == "reduce-overhead"
    n = [RECIPE_NOTE, "the recipe through lightning_perf.cli (LightningCLI) with its callbacks and logger as "
         "shipped that day; synthetic tokens"]
    if cg:
        n.append("CUDA graphs (compile: reduce-overhead): the window's allocated peak misses the graphs' pool "
                 "(RESULTS.md); only the reserved figure describes the replayed step")
    n += list(notes)
    add(id, path, key, device_name=doc["device"], world=1, side="pack",
        harness={"script": "benchmarks/bench_recipes.py", "recipe": row["name"], "variant": variant,
                 "variant_args": (row.get("variants") or {}).get(variant, {}).get("args") if variant else None,
                 "result_commit": commit, "precision_plugin": "PerfPrecision"},
        model=model(rc["preset"], model_class=PACK_GPT, fp8_impl=fp8_impl, **overrides),
        training=training(precision="bf16-mixed", mixed_precision=CLI_PRECISION, batch=rc["batch"],
                          seq_len=rc["seq_len"], compile_mode=rc["compile"], compile_scope=rc["scope"],
                          optimizer=ADAMW_MODULE, clip=1.0, warmup=doc.get("warmup"), timed=doc.get("steps"),
                          global_batch=rc["batch"]),
        strategy=single_device(), baseline=None,
        measured=measured(pointer(doc, key), allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"],
                          ranks="single_gpu",
                          scope="run" if "peak_mem_gb_before_window" in pointer(doc, key) else "window",
                          window="peak_mem_gb", before="peak_mem_gb_before_window", reserved="peak_reserved_gb",
                          reserved_only=cg),
        notes=tuple(n))


def add_plain_side(id: str, path: str, key: str, doc: dict, rc: dict, *, commit: str, notes: tuple = ()) -> None:
    side = pointer(doc, key)
    add(id, path, key, device_name=doc["device"], world=1, side="baseline",
        harness={"script": "benchmarks/bench_recipes.py", "recipe": None, "variant": "plain", "result_commit": commit,
                 "precision_plugin": "none (autocast in the loop)"},
        baseline={"name": "plain compiled loop", "model_class": PLAIN_GPT, "sharding": "none (one GPU)",
                  "mixed_precision": "torch.autocast bf16 over fp32 parameters"},
        model=model(rc["preset"], model_class=PLAIN_GPT),
        training=training(precision="bf16-mixed", mixed_precision=AUTOCAST, batch=rc["batch"], seq_len=rc["seq_len"],
                          compile_mode="default", compile_scope="model",
                          optimizer=ADAMW_MODULE | {"param_groups": "decay on matrices only (built in the loop)"},
                          clip=1.0, warmup=doc.get("warmup"), timed=doc.get("steps"), global_batch=rc["batch"]),
        strategy=single_device(PLAIN_LOOP),
        measured=measured(side, allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"], ranks="single_gpu",
                          scope="run" if "peak_mem_gb_before_window" in side else "window", window="peak_mem_gb",
                          before="peak_mem_gb_before_window", reserved="peak_reserved_gb"),
        notes=(PLAIN_NOTE, "the recipe's model with PyTorch kernels, SDPA, no FP8, separate "
                                      "q/k/v, torch.compile of the whole model; the recipe's learning-rate schedule "
                                      "from 2026-11-25 (no memory effect)") + tuple(notes))


# ---- the result files --------------------------------------------------------------------------------------


def build() -> list[dict[str, Any]]:
    ENTRIES.clear()
    # bench_parallel, two H200, 2026-11-22 (median-step era)
    add_parallel("bench_parallel_2xh200_20261122_all.json", fp8_impl=None, commit="2ccea96")
    add_parallel("bench_parallel_2xh200_20261122_eager.json", fp8_impl=None, commit="2ccea96")
    add_parallel("bench_parallel_2xh200_20261122.json", fp8_impl="inhouse", commit="2ccea96")
    # bench_parallel, 2026-11-27 (wall-clock era)
    for fname, commit in (("bench_parallel_2xh200_20261127_1.3b-model-parallel.json", "a352337"),
                          ("bench_parallel_2xh200_20261127_1.3b-units4-host.json", "d46699d"),
                          ("bench_parallel_2xh200_20261127_1.3b-zero3-gc.json", "a352337"),
                          ("bench_parallel_4xh200_20261127_llama8b-fp8-levers.json", "a352337"),
                          ("bench_parallel_4xh200_20261127_llama8b-fp8-no-ac-gather.json", "a352337"),
                          ("bench_parallel_4xh200_20261127_llama8b-fp8-gather-prefetch2.json", "a352337"),
                          ("bench_parallel_4xh200_20261127_llama8b-bf16.json", "a352337"),
                          ("bench_parallel_4xh200_20261127_llama8b-fp8-ctas-batch3.json", "c835e02")):
        add_parallel(fname, fp8_impl="torchao+pack", commit=commit)

    # bench_parallel3d, two H200 / two H100; bench_8gpu through bench_parallel3d's runner
    for fname in ("bench_parallel3d_2xh200_20261122_eager.json", "bench_parallel3d_2xh200_20261122_pp2.json",
                  "bench_parallel3d_2xh200_20261122_async-tp.json", "bench_parallel3d_2xh200_20261122_tp-split.json",
                  "bench_parallel3d_2xh200_20261122.json"):
        add_3d(f"{RESULTS}/{fname}", script="benchmarks/bench_parallel3d.py", fp8_impl="inhouse", commit="2ccea96")
    add_3d(f"{SHARED}/bench_parallel3d_2xh100_20261127_pp2-auto.json", script="benchmarks/bench_parallel3d.py",
           fp8_impl=None, commit="8741d22")
    doc8 = load(f"{RESULTS}/bench_8gpu_8xh200_20261122.json")
    add_3d(f"{RESULTS}/bench_8gpu_8xh200_20261122.json", script="benchmarks/bench_8gpu.py", fp8_impl=None,
           commit="2ccea96", specs=eight_gpu_specs(doc8))

    # bench_gpt, one GPU
    for fname, impl, commit in (
            ("bench_gpt_h100_20261125_1.3b-wallclock.json", None, "a778166"),
            ("bench_gpt_h100_20261125_124m-wallclock.json", None, "a778166"),
            ("bench_gpt_h200_20261122_1.3b-fp8.json", "inhouse", "2ccea96"),
            ("bench_gpt_h200_20261122_1.3b-kernels.json", None, "2ccea96"),
            ("bench_gpt_h200_20261122_124m-block.json", None, "2ccea96"),
            ("bench_gpt_h200_20261122_124m-fp8.json", "inhouse", "2ccea96"),
            ("bench_gpt_h200_20261122_124m-kernels.json", None, "2ccea96"),
            ("bench_gpt_h200_20261122_trainer.json", None, "2ccea96"),
            ("bench_gpt_h200_20261126_1.3b-fp8-wallclock.json", "torchao+pack", "05163aa"),
            ("bench_gpt_h200_20261126_124m-variants.json", None, "178e8d1")):
        add_gpt(fname, fp8_impl=impl, commit=commit)

    add_recipes()
    add_planned_recipes()
    add_offload()
    add_memory()
    add_hf_import()
    ids = [e["id"] for e in ENTRIES]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise ValueError(f"duplicate ids {sorted(dupes)}")
    quotes = json.loads(QUOTES.read_text())["quotes"]
    keys = {f"{e['source']['path']}#{e['source']['key']}": e for e in ENTRIES}
    orphans = sorted(set(quotes) - set(keys))
    if orphans:
        raise ValueError(f"{QUOTES.name} quotes figures of no entry: {orphans}")
    for key, entry in keys.items():
        entry["results_md"] = quotes.get(key)
    return ENTRIES


def add_recipes() -> None:
    R = RESULTS
    c124 = recipe_1gpu("gpt2-124m", None, "default")  # whole-model compile (2026-11-24 18:54 to 2026-11-25 07:24)
    cg124 = recipe_1gpu("gpt2-124m", None, "reduce-overhead")  # as shipped from 2026-11-25 07:24
    c13 = recipe_1gpu("gpt-1.3b", None, "default")
    fp8 = dict(kernels="triton", attention="auto", fused_qkv=True)

    def recipe_rows(fname: str, commit: str, recipes: dict[str, tuple[dict, Optional[str]]],
                    variants: dict[tuple, tuple[dict, Optional[str]]] = {}, notes: dict[tuple, tuple] = {},
                    path: Optional[str] = None) -> None:
        path = path or f"{R}/{fname}"
        doc = load(path)
        for r, row in enumerate(doc["rows"]):
            name = row["name"]
            rc, impl = recipes[name]
            tag = _tag(Path(path).name)
            side = row.get("plain")
            if isinstance(side, dict) and "tokens_per_s" in side and "same_as" not in side:
                base_rc = rc if rc["preset"] != "gpt-1.3b" else c13
                add_plain_side(f"recipes-{tag}-{name}-plain", path, f"/rows/{r}/plain", doc, base_rc, commit=commit,
                               notes=notes.get((name, "plain"), ()))
            rec = row.get("recipe")
            if isinstance(rec, dict) and "tokens_per_s" in rec:
                add_recipe_side(f"recipes-{tag}-{name}", path, f"/rows/{r}/recipe", doc, row, rc, fp8_impl=impl,
                                variant=None, commit=commit, notes=notes.get((name, "recipe"), ()))
            for label, res in (row.get("variants") or {}).items():
                if "tokens_per_s" not in res:
                    continue
                vrc, vimpl = variants[(name, label)]
                add_recipe_side(f"recipes-{tag}-{name}-{label}", path, f"/rows/{r}/variants/{label}", doc, row, vrc,
                                fp8_impl=vimpl, variant=label, commit=commit, notes=notes.get((name, label), ()))

    tensorwise = recipe_1gpu("gpt-1.3b-fp8", "tensorwise", "default", **fp8)
    delayed = recipe_1gpu("gpt-1.3b-fp8", "delayed", "default", **fp8)
    triton124 = recipe_1gpu("gpt2-124m", None, "default", kernels="triton", attention="auto", fused_qkv=True)
    inhouse_note = ("the recipe's fp8: true on 2026-11-24 before torchao replaced the in-house Float8Linear "
                    "(RESULTS.md: 'the in-house FP8 linear of the time')")
    for dev in ("h100", "h200"):
        recipe_rows(f"bench_recipes_{dev}_20261124_124m.json", "a8e08e7", {"gpt2-124m": (c124, None)},
                    {("gpt2-124m", "triton"): (triton124, None)})
        recipe_rows(f"bench_recipes_{dev}_20261124_1.3b.json", "a8e08e7",
                    {"gpt-1.3b": (c13, None), "gpt-1.3b-fp8": (tensorwise, "inhouse")},
                    notes={("gpt-1.3b-fp8", "recipe"): (inhouse_note,)})
    torch_k = recipe_1gpu("gpt-1.3b-fp8", "tensorwise", "default", kernels="torch", attention="sdpa", fused_qkv=True)
    recipe_rows("bench_recipes_h100_20261124_fp8-torchao.json", "f9e4109", {"gpt-1.3b-fp8": (tensorwise, "torchao")})
    recipe_rows("bench_recipes_h100_20261124_fp8-torchao-variants.json", "f9e4109",
                {"gpt-1.3b-fp8": (tensorwise, "torchao")}, {("gpt-1.3b-fp8", "torch-kernels"): (torch_k, "torchao")})
    ours = recipe_1gpu("gpt-1.3b-fp8", "tensorwise", "default", kernels="triton", attention="auto", fused_qkv=False)
    recipe_rows("bench_recipes_h200_20261124_fp8-torchao-vs-ours.json", "f9e4109",
                {"gpt-1.3b-fp8": (tensorwise, "torchao")}, {("gpt-1.3b-fp8", "ours"): (ours, "inhouse")},
                notes={("gpt-1.3b-fp8", "ours"): ("--bench.fp8_linear=ours: the FP8 projections built as the earlier "
                                                  "in-house linear for a same-run comparison",)})
    recipe_rows("bench_recipes_h100_20261124_fp8-hybrid.json", "f9e4109",
                {"gpt-1.3b-fp8": (tensorwise, "torchao+pack")})
    recipe_rows("bench_recipes_h100_20261125__fp8-schedule.json", "28637b7",
                {"gpt-1.3b-fp8": (tensorwise, "torchao+pack")})
    kernels124 = recipe_1gpu("gpt2-124m", None, "default", kernels="triton", attention="sdpa", fused_qkv=True)
    for fname in ("bench_recipes_h100_20261125_matched.json", "bench_recipes_h100_20261125_124m-again.json",
                  "bench_recipes_h100_20261125_124m-variants.json",
                  "bench_recipes_h100_20261125_124m-cg-recipe-first.json",
                  "bench_recipes_h100_20261125_124m-profile.json"):
        extra = ("profiled run (--profile 4): the profiler ran over the last steps of the window",) \
            if "profile" in fname else ()
        recipe_rows(fname, "85a71b3", {"gpt2-124m": (c124, None), "gpt-1.3b": (c13, None)},
                    {("gpt2-124m", "cg"): (cg124, None), ("gpt2-124m", "kernels"): (kernels124, None)},
                    notes={("gpt2-124m", "recipe"): extra, ("gpt2-124m", "plain"): extra})
    for fname in ("bench_recipes_h100_20261125__profile-lr-mismatch.json", "bench_recipes_h100_20261125__schedule.json",
                  "bench_recipes_h100_20261125__schedule-recipe-first.json"):
        extra = ("profiled run (--profile 4)",) if "profile" in fname else ()
        recipe_rows(fname, "6abc979", {"gpt-1.3b": (c13, None)}, notes={("gpt-1.3b", "recipe"): extra,
                                                                         ("gpt-1.3b", "plain"): extra})
    recipe_rows("bench_recipes_h100_20261125_fp8-delayed.json", "3cc8517",
                {"gpt-1.3b-fp8 with fp8: delayed": (delayed, "delayed")},
                notes={("gpt-1.3b-fp8 with fp8: delayed", "plain"): (
                    "assembled from the line the parent printed: window peak and reserved only",)})
    recipe_rows("bench_recipes_h100_20261125_fp8-delayed-shipped.json", "5504f09",
                {"gpt-1.3b-fp8": (delayed, "delayed")})
    recipe_rows("bench_recipes_h200_20261125_matched.json", "a0edec7",
                {"gpt2-124m": (cg124, None), "gpt-1.3b": (c13, None)})
    recipe_rows("bench_recipes_h200_20261126.json", "178e8d1",
                {"gpt2-124m": (cg124, None), "gpt-1.3b": (c13, None), "gpt-1.3b-fp8": (delayed, "delayed")})
    recipe_rows("bench_recipes_h200_20261126_clip-fold.json", "178e8d1", {"gpt-1.3b": (c13, None)},
                {("gpt-1.3b", "clip-in-place"): (c13, None)},
                notes={("gpt-1.3b", "clip-in-place"): ("--bench.clip=in_place: clipping as a separate pass before "
                                                       "the fused AdamW step",)})
    recipe_rows("bench_recipes_h200_20261126_fp8-clip-fold.json", "178e8d1", {"gpt-1.3b-fp8": (delayed, "delayed")})
    recipe_rows("bench_recipes_h200_20261126_fp8-profile.json", "178e8d1", {"gpt-1.3b-fp8": (delayed, "delayed")},
                notes={("gpt-1.3b-fp8", "recipe"): ("profiled run (--profile 4)",),
                       ("gpt-1.3b-fp8", "plain"): ("profiled run (--profile 4)",)})
    unfused = ("--bench.fp8_mlp=unfused: each delayed GELU MLP as its two layers around a separate GELU",)
    for fname, commit, form in (
            ("bench_recipes_h200_20261126_fp8-fused-mlp.json", "0b13f8e", "the shipped fused GELU MLP kernel"),
            ("bench_recipes_h200_20261126_fp8-mlp-first-kernel.json", "0b13f8e",
             "the first form of the fused GELU MLP kernel (since replaced)"),
            ("bench_recipes_h200_20261126_fp8-fused-mlp-tl-trans.json", "c2a5eb8",
             "the tl.trans form of the fused GELU MLP kernel (since replaced)")):
        recipe_rows(fname, commit, {"gpt-1.3b-fp8": (delayed, "delayed+fused_gelu_mlp")},
                    {("gpt-1.3b-fp8", "mlp-unfused"): (delayed, "delayed")},
                    notes={("gpt-1.3b-fp8", "recipe"): (f"recipe with {form}",),
                           ("gpt-1.3b-fp8", "mlp-unfused"): unfused})
    # shared H100 measurements of main at 8741d22
    recipe_rows("bench_recipes_h100_20261128_gpt-1.3b-fp8_plain.json", "8741d22",
                {"gpt-1.3b-fp8": (delayed, "delayed+fused_gelu_mlp")},
                path=f"{SHARED}/bench_recipes_h100_20261128_gpt-1.3b-fp8_plain.json")
    add_recipe_log()
    add_llama_recipes()


def add_recipe_log() -> None:
    """The recipe side of the H100 gpt-1.3b-fp8 call: only the line its parent printed (a .log)."""
    path = f"{SHARED}/bench_recipes_h100_20261128_gpt-1.3b-fp8_recipe.log"
    prefix = "[gpt-1.3b-fp8] recipe: "
    line = next(x for x in _path(path).read_text().splitlines() if x.startswith(prefix))
    row = json.loads(line[len(prefix):])
    rc = recipe_1gpu("gpt-1.3b-fp8", "delayed", "default", kernels="triton", attention="auto", fused_qkv=True)
    add("recipes-h100-20261128-gpt-1.3b-fp8-recipe-log", path, f"line:{prefix}", kind="log",
        device_name="NVIDIA H100 80GB HBM3", world=1, side="pack",
        harness={"script": "benchmarks/bench_recipes.py", "recipe": "gpt-1.3b-fp8", "variant": None,
                 "variant_args": "--recipe_first --timeout 250", "result_commit": "8741d22",
                 "precision_plugin": "PerfPrecision"},
        model=model("gpt-1.3b", model_class=PACK_GPT, fp8_impl="delayed+fused_gelu_mlp", kernels="triton",
                    attention="auto", fp8="delayed", fused_qkv=True),
        training=training(precision="bf16-mixed", mixed_precision=CLI_PRECISION, batch=8, seq_len=2048,
                          compile_mode="default", compile_scope="model", optimizer=ADAMW_MODULE, clip=1.0, warmup=10,
                          timed=20, global_batch=8),
        strategy=single_device(),
        measured=measured(row, allocated_from=["peak_mem_gb"], ranks="single_gpu", scope="window", window="peak_mem_gb",
                          reserved="peak_reserved_gb"),
        notes=(RECIPE_NOTE, "the device is not printed in the log: the call ran on the H100 host of "
               "/work/shared/measured/README.md (2026-11-27-h100)", "only the printed line survives (the process "
               "was killed after its window): the window's allocated peak and the reserved peak; no before-window "
               "figure"))


def add_llama_recipes() -> None:
    """llama-8b-zero3 through lightning-perf fit on four GPUs, and its ModelParallelStrategy baseline."""
    def llama_model(recipe: bool) -> dict:
        if recipe:
            return model("llama-8b", model_class=PACK_GPT, fp8_impl="torchao+pack", kernels="triton", attention="auto",
                         fp8="tensorwise", fused_qkv=True)
        return model("llama-8b", model_class=MP_GPT, kernels="torch", attention="sdpa")

    recipe_strategy = zero(3, 4, fp8_all_gather=True, init="meta")
    mp_strategy, mp_policy, mp_baseline = parallel_strategy({"baseline": "model_parallel"}, 4)
    fp8_note = ("FP8 all-gather: the FP8 weights are gathered as torchao's FP8 wrapper (torchao's matmul for them); "
                "peak and reserved are rank 0's (the recipe's window callback writes rank 0's figures)")
    for path, commit, dev in ((f"{RESULTS}/bench_recipes_4xh200_20261127_llama-8b-zero3.json", "a352337", "h200"),
                              (f"{RESULTS}/bench_recipes_4xh200_20261127_llama-8b-zero3-timeout.json", "a352337",
                               "h200-timeout"),
                              (f"{SHARED}/bench_recipes_4xh100_20261127_llama-8b-zero3.json", "8741d22", "h100")):
        doc = load(path)
        row = doc["rows"][0]
        tag = _tag(Path(path).name)
        h100 = dev == "h100"
        recipe_batch, recipe_ac = (3, "none") if h100 else (2, "none")
        common = dict(device_name=doc["device"], world=4)
        # the recipe side
        rec = row["recipe"]
        rec_training = training(precision="bf16-mixed", mixed_precision=MP_ZERO, batch=recipe_batch, seq_len=8192,
                                ac=recipe_ac, compile_mode="default", compile_scope="block", optimizer=ADAMW_MODULE,
                                clip=1.0, warmup=doc["warmup"], timed=doc["steps"],
                                global_batch=recipe_batch * 4)
        harness = {"script": "benchmarks/bench_recipes.py", "recipe": "llama-8b-zero3", "variant": None,
                   "variant_args": None, "result_commit": commit, "precision_plugin": "PerfPrecision"}
        if "tokens_per_s" in rec:
            add(f"recipes-{tag}-llama-8b-zero3", path, "/rows/0/recipe", side="pack", harness=harness,
                model=llama_model(True), training=rec_training, strategy=recipe_strategy,
                measured=measured(rec, allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"], ranks="rank0",
                                  scope="run", window="peak_mem_gb", before="peak_mem_gb_before_window",
                                  reserved="peak_reserved_gb"),
                notes=(RECIPE_NOTE, fp8_note, "the recipe of 2026-11-27 10:09 (commit 315b6ba): batch_size 2, FP8 "
                       "all-gathers, no activation checkpointing"), **common)
        elif "out of memory" in rec.get("error", "").lower():
            msr = oom_measured(rec["error"])
            msr["source_fields"] = {"oom.message": "error"}
            add(f"recipes-{tag}-llama-8b-zero3", path, "/rows/0/recipe", side="pack", harness=harness,
                model=llama_model(True), training=rec_training, strategy=recipe_strategy, measured=msr,
                notes=("the recipe as shipped at 8741d22 (batch_size 3, FP8 all-gathers, no activation "
                       "checkpointing) ran out of memory on 80 GB H100s", fp8_note), **common)
        # the H100 variant: one sequence, selective checkpointing
        if h100:
            var = row["variants"]["h100"]
            add(f"recipes-{tag}-llama-8b-zero3-h100-variant", path, "/rows/0/variants/h100", side="pack",
                harness=dict(harness, variant="h100", variant_args=var["args"]), model=llama_model(True),
                training=training(precision="bf16-mixed", mixed_precision=MP_ZERO, batch=1, seq_len=8192,
                                  ac="selective", compile_mode="default", compile_scope="block",
                                  optimizer=ADAMW_MODULE, clip=1.0, warmup=doc["warmup"], timed=doc["steps"],
                                  global_batch=4),
                strategy=recipe_strategy,
                measured=measured(var, allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"], ranks="rank0",
                                  scope="run", window="peak_mem_gb", before="peak_mem_gb_before_window",
                                  reserved="peak_reserved_gb"),
                notes=(RECIPE_NOTE, fp8_note, "quoted in /work/shared/measured/README.md (allocated and reserved); "
                       "the process was killed after its window (rc=-9), the window's record stands"),
                **common)
        # the ModelParallelStrategy baseline
        mp = row["mp"]
        mp_batch = 1 if h100 else 2
        mp_training = training(precision="32-true", mixed_precision=mp_policy, batch=mp_batch, seq_len=8192, ac="none",
                               compile_mode="default", compile_scope="block",
                               optimizer=ADAMW_MODULE | {"param_groups": "decay on matrices only (ModelParallelGPT)"},
                               clip=1.0, warmup=doc["warmup"], timed=doc["steps"], global_batch=mp_batch * 4)
        mp_harness = dict(harness, variant="mp", precision_plugin="Lightning Precision (32-true)")
        if "tokens_per_s" in mp:
            add(f"recipes-{tag}-llama-8b-zero3-mp", path, "/rows/0/mp", side="baseline", harness=mp_harness,
                model=llama_model(False), training=mp_training, strategy=mp_strategy, baseline=mp_baseline,
                measured=measured(mp, allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"], ranks="rank0",
                                  scope="run", window="peak_mem_gb", before="peak_mem_gb_before_window",
                                  reserved="peak_reserved_gb"),
                notes=("the baseline's window callback writes rank 0's figures",
                       f"--baselines mp --baseline_batch {mp_batch}: {mp_batch} sequences per GPU"), **common)
        elif "out of memory" in mp.get("error", "").lower():
            msr = oom_measured(mp["error"])
            msr["source_fields"] = {"oom.message": "error"}
            add(f"recipes-{tag}-llama-8b-zero3-mp", path, "/rows/0/mp", side="baseline", harness=mp_harness,
                model=llama_model(False), training=mp_training, strategy=mp_strategy, baseline=mp_baseline,
                measured=msr, notes=("--baseline_batch 1 without checkpointing: out of memory on 80 GB H100s",),
                **common)


def add_planned_recipes() -> None:
    """Recipes as shipped with their batch, checkpointing and accumulation left to the memory planner (2026-11-28)."""
    llama = model("llama-8b", model_class=PACK_GPT, fp8_impl="torchao+pack", kernels="triton", attention="auto",
                  fp8="tensorwise", fused_qkv=True)
    for fname, commit in (("bench_recipes_4xh100_20261128_llama-8b-zero3-auto.json", "c4a452b"),
                          ("bench_recipes_4xh100_20261128_llama-8b-zero3-auto-again.json", "3ab37e8")):
        path = f"{RESULTS}/{fname}"
        doc = load(path)
        rec = doc["rows"][0]["recipe"]
        train = training(precision="bf16-mixed", mixed_precision=MP_ZERO, batch=1, seq_len=8192, ac="none",
                         compile_mode="default", compile_scope="block", optimizer=ADAMW_MODULE, clip=1.0,
                         warmup=doc["warmup"], timed=doc["steps"], global_batch=64)
        train.update(accumulate_grad_batches=16, accumulation="reduce_each")
        add(f"recipes-{_tag(fname)}", path, "/rows/0/recipe", device_name=doc["device"], world=4, side="pack",
            harness={"script": "benchmarks/bench_recipes.py", "recipe": "llama-8b-zero3", "variant": None,
                     "variant_args": None, "result_commit": commit, "precision_plugin": "PerfPrecision"},
            model=llama, training=train, strategy=zero(3, 4, fp8_all_gather=True, init="meta"),
            measured=measured(rec, allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"], ranks="rank0",
                              scope="run", window="peak_mem_gb", before="peak_mem_gb_before_window",
                              reserved="peak_reserved_gb"),
            notes=(RECIPE_NOTE, "batch_size, activation_checkpointing and accumulation 'auto': the planner took micro-"
                   "batch 1, no checkpointing, 16 micro-batches per step with gradients reduce-scattered after "
                   "each (ZeroStrategy accumulation reduce_each), global batch 64 x 8192 tokens"))
    fname = "bench_recipes_2xh100_20261128_gpt-1.3b-zero3-auto.json"
    path = f"{RESULTS}/{fname}"
    doc = load(path)
    row = doc["rows"][0]
    gpt = model("gpt-1.3b", model_class=PACK_GPT, fp8_impl="torchao+pack", kernels="triton", attention="auto",
                fp8="tensorwise", fused_qkv=True)
    train = training(precision="bf16-mixed", mixed_precision=MP_ZERO, batch=4, seq_len=2048, ac="none",
                     compile_mode="default", compile_scope="block", optimizer=ADAMW_MODULE, clip=1.0, warmup=5,
                     timed=10, global_batch=16)
    train.update(accumulate_grad_batches=2, accumulation="gather_once")
    harness = {"script": "benchmarks/bench_recipes.py", "recipe": "gpt-1.3b-zero3", "variant": None,
               "variant_args": None, "result_commit": "e034f91", "precision_plugin": "PerfPrecision"}
    add(f"recipes-{_tag(fname)}", path, "/rows/0/recipe", device_name=doc["device"], world=2, side="pack",
        harness=harness, model=gpt, training=train, strategy=zero(3, 2, blocks_per_unit=2),
        measured=measured(row["recipe"], allocated_from=["peak_mem_gb"], ranks="rank0", scope="window",
                          window="peak_mem_gb", reserved="peak_reserved_gb"),
        notes=(RECIPE_NOTE, "the planner of that run took 4 sequences x 2 micro-batches, parameters kept gathered "
               "across them (gather_once)", doc["source"]))
    mp_training = training(precision="32-true", mixed_precision="FSDP2 MixedPrecisionPolicy (bf16 compute, fp32 master)",
                           batch=8, seq_len=2048, ac="full", compile_mode="default", compile_scope="block",
                           optimizer=ADAMW_MODULE | {"param_groups": "decay on matrices only (ModelParallelGPT)"},
                           clip=1.0, warmup=5, timed=10, global_batch=16)
    mp_strategy, _, mp_baseline = parallel_strategy({"baseline": "model_parallel"}, 2)
    add(f"recipes-{_tag(fname)}-mp", path, "/rows/0/mp", device_name=doc["device"], world=2, side="baseline",
        harness=dict(harness, variant="mp", precision_plugin="Lightning Precision (32-true)"),
        model=model("gpt-1.3b", model_class=MP_GPT, kernels="torch", attention="sdpa"), training=mp_training,
        strategy=mp_strategy, baseline=mp_baseline,
        measured=measured(row["mp"], allocated_from=["peak_mem_gb"], ranks="rank0", scope="window",
                          window="peak_mem_gb", reserved="peak_reserved_gb"),
        notes=("the harness of that day read the recipe's 'auto' checkpointing as checkpointing: the baseline ran "
               "with full activation checkpointing per block", doc["source"]))


def add_offload() -> None:
    for fname, leg, commit, extra in (
            ("bench_offload_h100_20261125_default.json", "native", "5504f09",
             "AdamW as the module picks it for CPU parameters after 5504f09 (torch's fused CPU kernel)"),
            ("bench_offload_h100_20261125_fused-adam.json", "native-fused-adam", "5504f09", "fused_adam=True given"),
            ("bench_offload_h100_20261125.json", "native", "5504f09",
             "the per-tensor AdamW loop (the module's default before 5504f09: fused=False)"),
            ("bench_offload_h100_20261125.json", "no-offload", "5504f09", "zero3 without offload")):
        path = f"{RESULTS}/{fname}"
        doc = load(path)
        cfg = doc["config"]
        res = doc["legs"][leg]
        offload = leg.startswith("native")
        strat = zero(3, 1, init="meta", offload="FSDP2 CPUOffloadPolicy (parameters, gradients and AdamW state "
                                                "in pinned host memory)" if offload else None)
        opt = dict(ADAMW_MODULE)
        if offload:
            opt.update(state_device="cpu", fused=(res.get("optimizer") or {}).get("fused"))
        kw = dict(device_name=doc["device"], world=1, side="pack",
                  harness={"script": "benchmarks/bench_offload.py", "variant": leg, "result_commit": commit,
                           "precision_plugin": "PerfPrecision (bf16-mixed)"},
                  model=model(cfg["model"], model_class=PACK_GPT, n_layer=cfg["layers"]),
                  training=training(precision=cfg["precision"], mixed_precision=MP_ZERO, batch=cfg["batch"],
                                    seq_len=cfg["seq_len"], optimizer=opt, warmup=cfg["warmup"], timed=cfg["steps"],
                                    global_batch=cfg["batch"]),
                  strategy=strat)
        ident = f"offload-{_tag(fname)}-{leg}"
        if "error" in res:
            msr = oom_measured(res["error"])
            msr["source_fields"] = {"oom.message": "error"}
            add(ident, path, f"/legs/{leg}", measured=msr, notes=(extra, "ZeroStrategy(stage=3, init='meta') on one "
                "GPU: FSDP2 on a one-rank mesh"), **kw)
            continue
        add(ident, path, f"/legs/{leg}",
            measured=measured(res, allocated_from=["peak_mem_gb", "peak_mem_gb_before_window"], ranks="single_gpu",
                              scope="run", window="peak_mem_gb", before="peak_mem_gb_before_window",
                              reserved="peak_reserved_gb"),
            notes=(extra, "the window resets peak stats after the warm-up; peak_reserved_gb is "
                   "torch.cuda.max_memory_reserved() after the fit (since that reset)",
                   "the host's peak RSS (host_peak_rss_gb) is in the source, not a GPU figure",
                   f"llama-8b cut to {cfg['layers']} layers"), **kw)


def add_memory() -> None:
    path = f"{RESULTS}/bench_memory_h100_20261125.json"
    doc = load(path)
    cfg = doc["config"]
    runs = doc["parts"]["checkpointing"]["runs"]
    spec = {"none": ("none", cfg["batch"], None), "selective": ("selective", cfg["batch"], None),
            "full": ("full", cfg["batch"], None), "none_half_batch": ("none", cfg["batch"] // 2, None),
            "none_compiled_model": ("none", cfg["batch"], "default")}
    for name, (ac, batch, compile_mode) in spec.items():
        cats = {"parameters": "parameters_gb", "gradients": "gradients_gb", "optimizer_state": "optimizer_state_gb",
                "activations": "activations_gb", "other": "other_gb", "fragmentation": "fragmentation_gb",
                "inactive_split": "inactive_split_gb"}
        if runs[name].get("saved_activations_gb") is not None:
            cats["saved_activations"] = "saved_activations_gb"
        add(f"memory-h100-20261125-{name.replace('_', '-')}", path, f"/parts/checkpointing/runs/{name}",
            device_name=doc["device"], world=1, side="pack",
            harness={"script": "benchmarks/bench_memory.py", "variant": name, "result_commit": "e8f8742",
                     "precision_plugin": "Trainer(precision='bf16-mixed')"},
            model=model(cfg["model"], model_class=PACK_GPT),
            training=training(precision=cfg["precision"], mixed_precision=AUTOCAST, batch=batch, seq_len=cfg["seq_len"],
                              ac=ac, compile_mode=compile_mode, compile_scope="model", optimizer=ADAMW_MODULE,
                              warmup=None, timed=cfg["steps"], global_batch=batch),
            strategy=single_device(),
            measured=measured(runs[name], allocated_from=["peak_allocated_gb"], ranks="single_gpu",
                              scope="training steps (MemoryMonitor resets the peak at every batch start; the "
                                    "largest step peak)",
                              reserved="peak_reserved_gb", categories=cats),
            notes=("MemoryMonitor(sample_step=1): parameters, gradients and optimizer state counted from the tensors "
                   "at step 1; activations = allocated after forward - allocated at batch start, at the peak step; "
                   "other = peak - those, floored at zero; peak_reserved_gb is the reserved peak of the peak step "
                   "(reset per step)",
                   f"{cfg['steps']} steps, eager unless compiled; no gradient clipping"))


def add_hf_import() -> None:
    path = f"{RESULTS}/bench_hf_import_h200_20261125.json"
    doc = load(path)
    for side in ("scratch", "hf"):
        add(f"hf-import-h200-20261125-{side}", path, f"/{side}", device_name=doc["device"], world=1, side="pack",
            harness={"script": "benchmarks/bench_hf_import.py", "recipe": doc["recipe"], "variant": side,
                     "result_commit": "a0edec7", "precision_plugin": "PerfPrecision"},
            model=model(doc["preset"], model_class=PACK_GPT, block_size=doc["seq_len"]),
            training=training(precision="bf16-mixed", mixed_precision=MP_ZERO, batch=doc["batch_size"],
                              seq_len=doc["seq_len"], optimizer=ADAMW_MODULE, clip=1.0, warmup=doc["warmup"],
                              timed=doc["steps"], global_batch=doc["batch_size"]),
            strategy=zero(3, 1, init="meta"),
            measured=measured(doc[side], allocated_from=["peak_mem_gb", "peak_mem_gb_to_first_step"],
                              ranks="single_gpu", scope="the window, and setup up to the first step (the warm-up "
                                                      "steps between fall in neither)",
                              window="peak_mem_gb", reserved="peak_reserved_gb",
                              extra={"peak_to_first_step": "peak_mem_gb_to_first_step"}),
            notes=(RECIPE_NOTE, "llama-1b-finetune recipe with devices: 1 (ZeRO-3 on a one-rank mesh), no compile, "
                   "no activation checkpointing; 'hf' loads a random-weight Hugging Face checkpoint, 'scratch' "
                   "initialises the preset", "peak_mem_gb_to_first_step: the allocated peak when the first step "
                   "starts (model, optimizer, sanity validation); no separate before-window figure"))


def main() -> None:
    entries = build()
    doc = {
        "description": "Peak GPU memory per GPU of every benchmarked configuration whose peak was recorded "
                       "(see README.md beside this file)",
        "unit": "GB = 1e9 bytes",
        "entries": entries,
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(entries)} entries to {OUT}")


if __name__ == "__main__":
    main()
