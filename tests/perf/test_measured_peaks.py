"""The measured peak-memory reference (tests/perf/data/measured_peaks.json): its schema, its consistency, and
that every figure in it is the one its result file holds."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "perf" / "data" / "measured_peaks.json"
QUOTES = ROOT / "tests" / "perf" / "data" / "results_md_quotes.json"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
GIB = 2**30
CAPACITY_GB = {"H100": 85.1, "H200": 150.2}  # 79.2 / 139.8 GiB as the devices report them

NUM = (int, float)
OPT_NUM = (int, float, type(None))
OPT_STR = (str, type(None))
OPT_BOOL = (bool, type(None))
OPT_INT = (int, type(None))

SCHEMA: dict[str, Any] = {
    "id": str, "date": OPT_STR, "device": str, "device_name": str, "world_size": int, "status": str, "side": str,
    "baseline": (dict, type(None)), "results_md": OPT_STR, "notes": list,
    "source": {"path": str, "key": str, "kind": str, "external": bool, "fields": dict},
    "harness": {"script": str, "variant": OPT_STR, "result_commit": str, "precision_plugin": str},
    "model": {"preset": str, "model_class": str, "overrides": dict, "n_layer": int, "n_embd": int, "n_head": int,
              "n_kv_head": int, "head_dim": int, "intermediate_size": int, "vocab_size": int,
              "padded_vocab_size": int, "block_size": int, "tie_embeddings": bool, "norm": str, "activation": str,
              "positions": str, "bias": bool, "kernels": str, "attention": str, "fp8": (bool, str),
              "fp8_impl": OPT_STR, "fused_qkv": bool, "num_params": int},
    "training": {"precision": str, "mixed_precision": str, "micro_batch_per_gpu": int, "pipeline_microbatch": OPT_INT,
                 "global_batch": OPT_INT, "seq_len": int, "accumulate_grad_batches": int,
                 "activation_checkpointing": str, "compile": {"mode": OPT_STR, "scope": OPT_STR}, "cuda_graphs": bool,
                 "optimizer": {"name": str, "fused": OPT_BOOL, "state_dtype": str, "state_device": str},
                 "gradient_clip_val": OPT_NUM, "steps": {"warmup": OPT_INT, "timed": OPT_INT}},
    "strategy": {"name": str, "family": str, "zero_stage": OPT_INT, "sharding": str, "reshard_after_forward": OPT_BOOL,
                 "blocks_per_unit": OPT_INT, "prefetch": OPT_INT, "fp8_all_gather": OPT_BOOL, "param_dtype": OPT_STR,
                 "reduce_dtype": OPT_STR, "offload": OPT_STR, "init": OPT_STR, "dp": int, "tp": int, "pp": int,
                 "cp": int, "pipeline_schedule": OPT_STR, "microbatches": OPT_INT, "stages_per_rank": OPT_INT,
                 "sequence_parallel": (bool, str, type(None)), "async_tp": OPT_BOOL, "tp_split": OPT_INT,
                 "tp_overlap": OPT_STR, "gradient_compression": OPT_STR},
    "measured": {"peak_allocated_gb": OPT_NUM, "allocated_from": list, "allocated_scope": OPT_STR,
                 "allocated_ranks": OPT_STR, "peak_allocated_gb_window": OPT_NUM,
                 "peak_allocated_gb_before_window": OPT_NUM, "peak_reserved_gb": OPT_NUM, "reserved_ranks": OPT_STR,
                 "reserved_only": bool, "compare_on": str, "categories_gb": (dict, type(None)),
                 "extra_gb": (dict, type(None)), "oom": (dict, type(None))},
}


def _entries() -> list[dict[str, Any]]:
    doc = json.loads(DATA.read_text())
    assert doc["unit"] == "GB = 1e9 bytes"
    return doc["entries"]


ENTRIES = _entries()


def _check(value: Any, schema: Any, where: str) -> list[str]:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where}: a dict expected, got {type(value).__name__}"]
        problems = [f"{where}.{k}: missing" for k in schema if k not in value]
        for k, sub in schema.items():
            if k in value:
                problems += _check(value[k], sub, f"{where}.{k}")
        return problems
    types = schema if isinstance(schema, tuple) else (schema,)
    # a bool is an int to isinstance: count it only where bool is allowed
    if isinstance(value, bool) and bool not in types:
        return [f"{where}: {value!r} is a bool, expected {types}"]
    return [] if isinstance(value, types) else [f"{where}: {value!r} is not {types}"]


def _source_doc(entry: dict[str, Any]) -> Any:
    """The object the entry's key points at, or None for an external source this machine lacks."""
    src = entry["source"]
    path = Path(src["path"]) if src["external"] else ROOT / src["path"]
    if not path.is_file():
        return None
    if src["kind"] == "log":
        prefix = src["key"][len("line:"):]
        line = next(x for x in path.read_text().splitlines() if x.startswith(prefix))
        return json.loads(line[len(prefix):])
    doc: Any = json.loads(path.read_text())
    for part in src["key"].lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_entry_schema(entry: dict[str, Any]) -> None:
    assert _check(entry, SCHEMA, entry.get("id", "?")) == []
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*", entry["id"])
    assert entry["device"] in CAPACITY_GB and entry["device"] in entry["device_name"]
    assert entry["status"] in ("ok", "oom") and entry["side"] in ("pack", "baseline")
    assert (entry["baseline"] is not None) == (entry["side"] == "baseline")
    assert entry["world_size"] >= 1
    assert all(isinstance(n, str) and n for n in entry["notes"])


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_entry_is_consistent(entry: dict[str, Any]) -> None:
    model, train, strat, meas = entry["model"], entry["training"], entry["strategy"], entry["measured"]
    assert model["head_dim"] * model["n_head"] == model["n_embd"]
    assert model["n_head"] % model["n_kv_head"] == 0
    assert model["vocab_size"] <= model["padded_vocab_size"]
    assert (model["fp8"] is False) == (model["fp8_impl"] is None)
    assert 0 < train["seq_len"] <= model["block_size"] and train["micro_batch_per_gpu"] > 0
    assert strat["dp"] * strat["tp"] * strat["pp"] * strat["cp"] == entry["world_size"]
    if strat["pp"] > 1:
        assert strat["microbatches"] and train["micro_batch_per_gpu"] % strat["microbatches"] == 0
    assert train["cuda_graphs"] == (train["compile"]["mode"] == "reduce-overhead")
    if meas["reserved_only"]:  # the allocated figures miss the CUDA graphs' pool
        assert train["cuda_graphs"] and meas["compare_on"] in ("reserved", "none")
        assert meas["compare_on"] == ("reserved" if meas["peak_reserved_gb"] is not None else "none")
    capacity = CAPACITY_GB[entry["device"]]
    if entry["status"] == "oom":
        oom = meas["oom"]
        assert meas["peak_allocated_gb"] is None and meas["compare_on"] == "lower_bound"
        assert oom["allocated_by_pytorch_gib"] * GIB / 1e9 < oom["lower_bound_gb"]
        assert oom["capacity_gib"] * GIB / 1e9 <= capacity
        return
    assert meas["oom"] is None and meas["compare_on"] in ("allocated", "reserved", "none")
    for key in ("peak_allocated_gb_window", "peak_allocated_gb_before_window", "peak_reserved_gb"):
        # every figure beside the peak is read from a named key of the source
        assert (meas[key] is not None) == (key in entry["source"]["fields"]), key
    assert (meas["peak_reserved_gb"] is None) == (meas["reserved_ranks"] is None)
    peak = meas["peak_allocated_gb"]
    assert peak is not None and 0 < peak < capacity and meas["allocated_from"]
    for key in ("peak_allocated_gb_window", "peak_allocated_gb_before_window"):
        if meas[key] is not None:
            assert meas[key] <= peak + 1e-9
    if meas["peak_reserved_gb"] is not None:
        assert 0 < meas["peak_reserved_gb"] < capacity
        if meas["peak_allocated_gb_window"] is not None and meas["reserved_ranks"] == meas["allocated_ranks"]:
            assert meas["peak_reserved_gb"] >= meas["peak_allocated_gb_window"]
    if meas["categories_gb"] is not None:
        cats = meas["categories_gb"]
        parts = cats["parameters"] + cats["gradients"] + cats["optimizer_state"] + cats["activations"]
        # MemoryMonitor's "other" is the rest of the peak, floored at zero (perf.memory.MemoryReport.other)
        assert cats["other"] == pytest.approx(max(0.0, peak - parts), abs=1e-6)
        assert min(cats.values()) >= 0


def test_ids_are_unique() -> None:
    ids = [e["id"] for e in ENTRIES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_source_exists_or_is_external(entry: dict[str, Any]) -> None:
    src = entry["source"]
    assert src["kind"] in ("json", "log")
    if src["external"]:
        assert Path(src["path"]).is_absolute() and src["path"].startswith("/work/shared/measured/")
    else:
        assert not Path(src["path"]).is_absolute() and (ROOT / src["path"]).is_file(), src["path"]
        assert src["path"].startswith("benchmarks/results/")
    if src["kind"] == "json":
        assert src["key"].startswith("/")
    else:
        assert src["key"].startswith("line:")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_figures_are_the_source_s(entry: dict[str, Any]) -> None:
    row = _source_doc(entry)
    if row is None:
        pytest.skip(f"external source not on this machine: {entry['source']['path']}")
    meas, fields = entry["measured"], entry["source"]["fields"]
    if entry["status"] == "oom":
        message = row[fields["oom.message"]]
        assert "out of memory" in message.lower()
        assert f"{meas['oom']['allocated_by_pytorch_gib']:.2f} GiB is allocated by PyTorch" in message
        return
    recorded = [row[k] for k in meas["allocated_from"] if row.get(k) is not None]
    assert meas["peak_allocated_gb"] == max(recorded)
    for field, key in fields.items():
        group, _, name = field.partition(".")
        value = meas[group][name] if name else meas[group]
        assert value == row[key], (field, key)


def test_results_md_quotes_point_at_cited_files() -> None:
    text = RESULTS_MD.read_text()
    quotes = json.loads(QUOTES.read_text())["quotes"]
    by_source = {f"{e['source']['path']}#{e['source']['key']}": e for e in ENTRIES}
    assert set(quotes) <= set(by_source), sorted(set(quotes) - set(by_source))
    for key, entry in by_source.items():
        assert entry["results_md"] == quotes.get(key), entry["id"]
        if entry["results_md"] and not entry["source"]["external"]:
            assert Path(entry["source"]["path"]).name in text, entry["id"]


def _peak_objects(doc: Any, key: str = "") -> list[str]:
    """JSON pointers of the objects in ``doc`` that record a peak allocated figure in GB."""
    found = []
    if isinstance(doc, dict):
        if any(isinstance(doc.get(k), NUM) for k in ("peak_mem_gb", "peak_allocated_gb")):
            found.append(key)
        for k, v in doc.items():
            found += _peak_objects(v, f"{key}/{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _peak_objects(v, f"{key}/{i}")
    return found


def test_every_recorded_peak_in_the_results_has_an_entry() -> None:
    covered = {(e["source"]["path"], e["source"]["key"]) for e in ENTRIES}
    missing = []
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        rel = str(path.relative_to(ROOT))
        doc = json.loads(path.read_text())
        for key in _peak_objects(doc):
            obj = _source_doc({"source": {"path": rel, "key": key, "kind": "json", "external": False}}) if key else doc
            if isinstance(obj, dict) and "same_as" in obj:  # a copy of another row's plain run, same measurement
                continue
            if (rel, key) not in covered:
                missing.append(f"{rel}{key}")
    assert missing == []
