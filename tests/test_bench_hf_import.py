"""``benchmarks/bench_hf_import.py``: its smoke (a tiny random Llama written by ``transformers``, the fine-tuning
recipe through the CLI from that folder and from scratch, each side a process forked from the warm
interpreter) and the Llama config it writes for the GPU run, mapped back by the pack's importer."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from _warm import python

from lightning_perf.models import GPTConfig

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_hf_import", ROOT / "benchmarks" / "bench_hf_import.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    bench = _bench()
    out = tmp_path_factory.mktemp("bench_hf_import")
    path = bench.main(
        ["--smoke", "--out", str(out)],
        run=lambda cmd, timeout: python(cmd[1:], timeout=timeout),
    )
    return bench, json.loads(path.read_text())


def test_smoke_trains_both_sides_through_the_recipe(smoke):
    bench, report = smoke
    assert "error" not in report["hf"], report["hf"]["error"]
    assert "error" not in report["scratch"], report["scratch"]["error"]
    # transformers' model has exactly the parameters the pack counts for the preset's shape
    assert report["checkpoint"]["parameters"] == report["parameters"]
    assert report["checkpoint"]["files"] == ["model.safetensors"]
    assert report["checkpoint"]["dtypes"] == ["bfloat16"]
    recipe = yaml.safe_load(
        (ROOT / "lightning_perf" / "configs" / f"{bench.RECIPE}.yaml").read_text()
    )
    data = recipe["data"]
    batch = data["batch_size"]
    if batch == "auto":  # the recipe's global batch on the one GPU the benchmark runs it on
        batch = data["global_batch_size"] // data.get("global_batch_per_gpus", 1)
    tokens = batch * bench.SMOKE_SEQ_LEN * 2  # 2 timed steps
    for side in ("hf", "scratch"):
        r = report[side]
        assert (r["steps_timed"], r["tokens"]) == (2, tokens)
        assert r["tokens_per_s"] == pytest.approx(tokens / r["wall_s"])
        assert (r["strategy"], r["precision_plugin"]) == (
            "ZeroStrategy",
            "PerfPrecision",
        )
        assert 0 < r["model_setup_s"] < r["start_to_first_step_s"]
    # only the imported side holds the checkpoint's values at its first step
    assert report["hf"]["starts_from_checkpoint"] is True
    assert report["scratch"]["starts_from_checkpoint"] is False
    assert report["hf_vs_scratch"] == pytest.approx(
        report["hf"]["tokens_per_s"] / report["scratch"]["tokens_per_s"]
    )
    assert report["load_s_hf_minus_scratch"] == pytest.approx(
        report["hf"]["start_to_first_step_s"]
        - report["scratch"]["start_to_first_step_s"]
    )


def test_gpu_checkpoint_config_is_the_llama_1b_preset():
    """The LlamaConfig the GPU run writes reads back, through the pack's importer, as the llama-1b preset."""
    from lightning_perf.models.gpt.hf import config_from_hf

    bench = _bench()
    preset = GPTConfig.from_name(bench.PRESET)
    hf = bench.llama_config(preset).to_dict()
    assert (
        hf["hidden_size"],
        hf["num_key_value_heads"],
        hf["tie_word_embeddings"],
    ) == (2048, 8, False)
    imported = dataclasses.asdict(config_from_hf(hf))
    expected = dataclasses.asdict(preset)
    for field in (
        "name",
        "pad_vocab_multiple",
    ):  # 128256 is a multiple of 64: no padding either way
        imported.pop(field), expected.pop(field)
    assert imported == expected


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    bench = _bench()
    cfg = GPTConfig.from_name(bench.SMOKE_PRESET, **bench.SMOKE_SHAPE)
    bench.write_random_llama(cfg.replace(n_kv_head=4), tmp_path)
    with pytest.raises(SystemExit, match=r"n_kv_head.*\(2, 4\)"):
        bench.check_same_shape(cfg, tmp_path, {})
