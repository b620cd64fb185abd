"""The memory planner against every measured peak it covers (``tests/perf/data/measured_peaks.json``).

Each entry's configuration (model, strategy, batch, precision, checkpointing, compile) goes through
``lightning_perf.estimate_memory`` as a user would pass it; the prediction must be within 10% of the measured
``torch.cuda.max_memory_allocated()``. Entries the planner does not cover are left out with the reason
(:data:`NOT_COVERED`); configurations it covers but misses are listed in :data:`KNOWN_MISSES` with the reason
and a bound on their error, so an improvement or a regression shows.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

import lightning_perf
from lightning_perf.models import GPTConfig, GPTLightningModule
from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

DATA = Path(__file__).parent / "data" / "measured_peaks.json"
TOLERANCE = 0.10

_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "norm",
           "activation", "positions", "tie_embeddings", "bias", "kernels", "attention", "fused_qkv")

#: why an entry is not a configuration the planner predicts
NOT_COVERED = {
    "plain loop": "a bare nn.Module in a hand-written loop (benchmarks/_baselines.plain_training_loop), not a "
                  "Lightning run of the pack's module",
    "retired fp8": "an FP8 linear the code no longer has (the in-house linear of 2026-11-22, or torchao's matmul "
                   "for every weight)",
    "no allocated figure": "a CUDA-graph run (its pool is reserved, not allocated per step) or an out-of-memory run",
}

#: covered but outside 10% today: id prefix -> (the bound on |error| that holds now, why)
KNOWN_MISSES: dict[str, tuple[float, str]] = {
    "parallel3d-2xh200-20261122-eager-pp2": (0.20, "uncompiled 2026-11-22 pipelines on fp32 weights: the "
                                             "schedule's buffers per micro-batch are not modelled"),
    "parallel3d-2xh200-20261122-pp2-pp2-1f1b-m4-compile": (0.20, "as the uncompiled pipelines"),
    "parallel3d-2xh100-20261127-pp2-auto-pp2-auto-compile": (0.15, "interleaved stages: the warm-up's micro-batches "
                                                             "per virtual stage are approximated"),
    "parallel3d-2xh200-20261122-eager-llama8b": (0.25, "llama-8b pp2 / tp2 uncompiled with full checkpointing on "
                                                 "fp32 weights: about 15 GB per GPU not accounted for"),
    "8gpu-8xh200-20261122-llama8b-pp2-tp2-dp2": (0.25, "pp2 x tp2 x dp2: the interleaved warm-up is approximated"),
    "offload-h100-20261125": (0.15, "FSDP2 CPU offload: the device copies of the gathered units are counted high"),
    "gpt-h100-20261125-124m-wallclock-trainer-triton-compile": (0.15, "gpt2-124m: the compiled block keeps less "
                                                                "than counted at d=768"),
    "parallel-2xh200-20261122-all-lightning-ddp": (0.15, "Lightning's DDP baseline"),
    "parallel-2xh200-20261122-all-lightning-fsdp": (0.15, "Lightning's FSDPStrategy (FSDP1 flat parameters)"),
    "parallel-2xh200-20261122-eager-lightning-fsdp": (0.15, "Lightning's FSDPStrategy (FSDP1 flat parameters)"),
    "parallel-2xh200-20261122-lightning-fsdp": (0.15, "Lightning's FSDPStrategy (FSDP1 flat parameters)"),
    "8gpu-8xh200-20261122-gpt13b-dp8-lightning-fsdp": (0.15, "Lightning's FSDPStrategy (FSDP1 flat parameters)"),
    "parallel-2xh200-20261127-1.3b-model-parallel-lightning-model-parallel": (0.15, "the ModelParallelGPT baseline's "
                                                                              "own loss"),
    "parallel-2xh200-20261127-1.3b-units4-host-lightning-model-parallel": (0.15, "the ModelParallelGPT baseline's "
                                                                           "own loss"),
    "recipes-2xh100-20261128-gpt-1.3b-zero3-auto-mp": (0.15, "the ModelParallelGPT baseline with full checkpointing "
                                                       "(checkpoint_wrapper): its recomputation counted high"),
}


def _entries() -> list[dict[str, Any]]:
    return json.loads(DATA.read_text())["entries"]


def not_covered(entry: dict[str, Any]) -> Optional[str]:
    if entry["model"]["model_class"].startswith("lightning_perf GPT as a bare"):
        return "plain loop"
    impl = entry["model"].get("fp8_impl") or ""
    if entry["model"].get("fp8") and ("in-house" in impl or "matmul throughout" in impl):
        return "retired fp8"
    if entry["measured"].get("compare_on") != "allocated" or entry["measured"].get("peak_allocated_gb") is None:
        return "no allocated figure"
    return None


def _config(m: dict[str, Any]) -> GPTConfig:
    kw = {k: m[k] for k in _FIELDS if m.get(k) is not None}
    fp8 = m.get("fp8")
    kw["fp8"] = "tensorwise" if fp8 is True else (fp8 if fp8 not in (False, None, "none") else None)
    return GPTConfig(name=m.get("preset") or "custom", **kw)


def _strategy(entry: dict[str, Any]) -> Any:
    s, t = entry["strategy"], entry["training"]
    family = s["family"]
    if family == "single-gpu":
        return None
    if family.startswith("zero"):
        return ZeroStrategy(stage=s["zero_stage"], blocks_per_unit=s.get("blocks_per_unit") or 1,
                            prefetch=s.get("prefetch") or 1, fp8_all_gather=bool(s.get("fp8_all_gather")),
                            offload_optimizer=bool(s.get("offload")), init="meta")
    if family.startswith("parallel3d"):
        kw: dict[str, Any] = dict(
            data_parallel_size=s["dp"], tensor_parallel_size=s["tp"], pipeline_parallel_size=s["pp"],
            zero_stage=s.get("zero_stage") or 0, fp8_all_gather=bool(s.get("fp8_all_gather")),
            compile=t["compile"]["mode"], activation_checkpointing=t["activation_checkpointing"] or "none")
        if s["pp"] > 1:
            kw.update(pipeline_schedule=s.get("pipeline_schedule") or "1f1b", num_microbatches=s.get("microbatches"),
                      stages_per_rank=s.get("stages_per_rank") or 1)
        if s.get("sequence_parallel") is not None:
            kw["sequence_parallel"] = s["sequence_parallel"]
        return Parallel3DStrategy(**kw)
    return {"lightning-fsdp": FSDPStrategy, "lightning-model-parallel": ModelParallelStrategy,
            "lightning-ddp": DDPStrategy}[family]()


def predicted_gb(entry: dict[str, Any]) -> float:
    """``estimate_memory``'s peak for a measured entry, its configuration passed as a user passes it."""
    t = entry["training"]
    in_3d = entry["strategy"]["family"].startswith("parallel3d")
    scope = "model" if (t["compile"].get("scope") or "block") == "model" else "block"
    module = GPTLightningModule(_config(entry["model"]), compile=None if in_3d else t["compile"]["mode"],
                                compile_scope=scope, activation_checkpointing=t["activation_checkpointing"] or "none")
    est = lightning_perf.estimate_memory(module, _strategy(entry), devices=entry["world_size"],
                                         batch_size=t["micro_batch_per_gpu"], seq_len=t["seq_len"],
                                         precision=t["precision"],
                                         accumulate_grad_batches=t.get("accumulate_grad_batches") or 1,
                                         accumulation=t.get("accumulation"))
    return est.peak_gb


COVERED = [e for e in _entries() if not_covered(e) is None]


def _known_miss(entry_id: str) -> Optional[tuple[float, str]]:
    for prefix, value in KNOWN_MISSES.items():
        if entry_id.startswith(prefix):
            return value
    return None


@pytest.mark.parametrize("entry", COVERED, ids=[e["id"] for e in COVERED])
def test_prediction_within_tolerance(entry: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = predicted_gb(entry)
    measured = entry["measured"]["peak_allocated_gb"]
    error = predicted / measured - 1
    miss = _known_miss(entry["id"])
    bound = TOLERANCE if miss is None else miss[0]
    assert abs(error) <= bound, (f"{entry['id']}: predicted {predicted:.2f} GB against {measured:.2f} GB measured "
                                 f"({error:+.1%}, bound {bound:.0%})")


def test_most_covered_entries_are_within_ten_percent() -> None:
    """The known misses stay a minority of what the planner covers, and every one of them is still covered."""
    missed = [e for e in COVERED if _known_miss(e["id"]) is not None]
    assert len(COVERED) >= 130
    assert len(missed) <= 0.2 * len(COVERED)
    for prefix in KNOWN_MISSES:
        assert any(e["id"].startswith(prefix) for e in COVERED), f"{prefix} matches no covered entry: drop it"


#: out-of-memory runs predicted to fit today: id -> why
OOM_MISSES = {
    "8gpu-8xh200-20261122-llama8b-tp8": "tp8 at 32 x 4096 tokens per rank on fp32 weights under autocast: the "
                                        "vocab-parallel loss and the sequence-parallel gathers are counted low",
}


def test_out_of_memory_runs_are_predicted_over_their_lower_bound() -> None:
    """A run that ran out of memory is predicted at least at what it held when it failed."""
    checked = 0
    for entry in _entries():
        if entry["status"] != "oom" or not_covered(entry) in ("plain loop", "retired fp8") or entry["id"] in OOM_MISSES:
            continue
        bound = (entry["measured"].get("oom") or {}).get("lower_bound_gb")
        if bound is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            predicted = predicted_gb(entry)
        assert predicted >= 0.9 * bound, f"{entry['id']}: predicted {predicted:.1f} GB, it failed holding {bound:.1f}"
        checked += 1
    assert checked >= 2
