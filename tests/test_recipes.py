"""Every shipped recipe runs through ``lightning-perf fit --config NAME`` on the CPU.

Each recipe keeps its own precision, gradient clipping, strategy (its layout, schedule, sharding,
activation checkpointing), device count, callbacks, loggers and checkpointing; only what a CPU cannot
hold is stood in for: the tiny Llama-shaped GPT, uncompiled, synthetic tokens, gloo, and the fused
AdamW forced on so that clipping meets the fused optimizer as it does on a GPU. The run is as short
as still covers every path: two steps (the second with the optimizer state the first made), one
validation batch at the end and one checkpoint, no sanity check, and a pipeline runs the fewest
microbatches its schedule takes (one per pipeline rank) in the recipe's batch. The layout itself is never
shrunk: every parallel dimension a recipe has is > 1 and the smallest world that keeps them all is
the recipe's own (``llama-8b-3d``: pp2 x tp2 x dp2 = 8 ranks). The run must finish and write only
under the recipe's own ``trainer.default_root_dir``. A new file in ``lightning_perf/configs/`` is
covered without editing this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from _warm import python

from lightning_perf.cli import recipe_dir, recipe_names

STEPS = 2
STAND_IN_MODEL = {
    "config": "tiny-llama",
    "config_overrides": {"n_embd": 64, "vocab_size": 256, "block_size": 64},
    "compile": None,
    "fused_adam": True,
}


def _tiny_hf_folder(path: Path) -> Path:
    """A Hugging Face checkpoint folder of the stand-in model, for recipes that start from one."""
    from lightning_perf.models import GPT, GPTConfig

    cfg = GPTConfig.from_name(STAND_IN_MODEL["config"], **STAND_IN_MODEL["config_overrides"])
    GPT(cfg).save_hf(path)
    return path


def _stand_in(recipe: dict, side: Path) -> dict:
    """The overrides that make ``recipe`` fit a CPU, as a second ``--config`` layered on the recipe."""
    trainer = recipe.get("trainer") or {}
    data = recipe.get("data") or {}
    stand_in: dict = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": STEPS,
            "val_check_interval": STEPS,
            "limit_val_batches": 1,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
        },
        "model": _stand_in_model(recipe, side),
        "data": {
            "source": "synthetic",
            "data_dir": None,
            "seq_len": 32,
            # the recipe's own ("auto", or whole pipeline microbatches)
            "batch_size": data.get("batch_size", 8) if data.get("batch_size") == "auto" else int(data.get("batch_size", 8)),
            "num_workers": 0,
            "synthetic_train_samples": 256,
            "synthetic_val_samples": 64,
        },
    }
    if data.get("global_batch_tokens") is not None:  # the recipe's tokens per GPU at the stand-in's seq_len
        per_gpus = int(data.get("global_batch_per_gpus") or 1)
        stand_in["data"].update(global_batch_tokens=None, global_batch_size=2 * per_gpus)
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):
        args = dict(strategy.get("init_args") or {})
        if "compile" in args:
            args["compile"] = None
        if "num_microbatches" in args:  # the fewest the schedule takes: one per pipeline rank
            args["num_microbatches"] = int(args.get("pipeline_parallel_size", 1))
        stand_in["trainer"]["strategy"] = {"class_path": strategy["class_path"], "init_args": args}
    if (trainer.get("callbacks") or []) and any("ModelCheckpoint" in str(c) for c in trainer["callbacks"]):
        # the recipe's own checkpoint callback with a step the run reaches
        stand_in["trainer"]["callbacks"] = [
            dict(c, init_args={**(c.get("init_args") or {}), "every_n_train_steps": STEPS})
            if "ModelCheckpoint" in c.get("class_path", "") else c
            for c in trainer["callbacks"]
        ]
    return stand_in


# recipe settings the stand-in keeps: they change the code the step runs, not the model's size
KEPT_OVERRIDES = ("fp8", "fused_qkv")


def _stand_in_model(recipe: dict, side: Path) -> dict:
    model = dict(STAND_IN_MODEL)
    own = (recipe.get("model") or {}).get("config_overrides") or {}
    model["config_overrides"] = {**STAND_IN_MODEL["config_overrides"],
                                 **{k: v for k, v in own.items() if k in KEPT_OVERRIDES}}
    hf = (recipe.get("model") or {}).get("init_from_hf")
    if hf is not None:  # the stand-in's weights in a Hugging Face folder; its config comes from there
        model.update(config=None, config_overrides=None, init_from_hf=str(_tiny_hf_folder(side / "hf")))
    return model


def _tree(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


def test_recipes_are_shipped_in_the_package():
    names = recipe_names()
    assert "gpt-tiny-cpu" in names and "gpt2-124m" in names
    assert all((recipe_dir() / f"{n}.yaml").is_file() for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("name", recipe_names())
def test_recipe_runs_through_the_cli_on_cpu(name, tmp_path):
    recipe = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    root = Path(recipe["trainer"]["default_root_dir"])
    cwd, side = tmp_path / "run", tmp_path / "side"
    cwd.mkdir()
    side.mkdir()
    stand_in = side / "cpu.yaml"
    stand_in.write_text(yaml.safe_dump(_stand_in(recipe, side)))
    proc = python(["-m", "lightning_perf", "fit", "--config", name, "--config", stand_in], cwd=cwd, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached" in proc.stdout + proc.stderr
    written = _tree(cwd)
    assert written, "the run wrote nothing"
    outside = sorted(str(p) for p in written if root not in p.parents)
    assert not outside, f"{name} wrote outside {root}: {outside[:10]}"
    assert any(p.suffix == ".ckpt" or p.name == ".metadata" for p in written), sorted(map(str, written))[:20]
    assert "lightning-perf: wrote" in proc.stdout


def test_the_wheel_carries_the_recipes():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parent.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p.relative_to(root / "lightning_perf") for g in data["lightning_perf"] for p in (root / "lightning_perf").glob(g)}
    assert {Path("configs") / f"{n}.yaml" for n in recipe_names()} <= shipped
