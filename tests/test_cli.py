"""The command line: a real `fit` subprocess on the tiny recipe, then `generate` from its checkpoint."""

import re
from pathlib import Path

import pytest
import yaml
from _warm import python

from lightning_perf.cli import perf_precision_for, recipe_dir, recipe_names

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd, timeout=600):
    proc = python(["-m", "lightning_perf", *args], cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A fit of the default recipe, as a user starts it (progress bar and all); its output in fit.log."""
    cwd = tmp_path_factory.mktemp("cli")
    proc = _run(["fit", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches",
                 "1", "--data.seq_len", "32", "--data.batch_size", "2", "--data.builtin_max_bytes", "100000",
                 "--trainer.log_every_n_steps", "1"], cwd)
    (cwd / "fit.log").write_text(proc.stdout + proc.stderr)
    return cwd


def test_fit_writes_checkpoint_and_logs(fitted):
    run = fitted / "runs" / "gpt-tiny-cpu"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    metrics = (run / "csv" / "version_0" / "metrics.csv").read_text()
    assert "train/loss" in metrics and "val/loss" in metrics
    assert any((run / "tensorboard").rglob("events.out.tfevents.*"))


def test_fit_shows_what_the_user_can_act_on(fitted):
    output = (fitted / "fit.log").read_text()
    # the summary's FLOPs at the length trained (--data.seq_len 32), not the model's block_size (256)
    assert "MFLOP/token at T=32" in output and "T=256" not in output
    # the bar counts steps of max_steps, with no epoch of -2 and no logger version
    assert re.search(r"Step\s.*\b4/4\b", output), output[-2000:]
    assert "Epoch 0/-2" not in output and "v_num" not in output
    # Lightning's tips to install its cloud packages and torch's LeafSpec deprecation are left out
    assert "litlogger" not in output and "litmodels" not in output and "LeafSpec" not in output
    assert "GPU available: False" in output  # and only those: Lightning's other lines stay


def test_generate_from_checkpoint(fitted):
    ckpt = fitted / "runs" / "gpt-tiny-cpu" / "checkpoints" / "last.ckpt"
    out = _run(["generate", "--ckpt_path", str(ckpt), "--prompt", "def main(", "--max_new_tokens", "12",
                "--device", "cpu"], fitted).stdout
    assert out.startswith("def main(")


def test_generate_refuses_missing_and_corrupt_checkpoints(tmp_path):
    proc = python(["-m", "lightning_perf", "generate", "--ckpt_path", tmp_path / "no.ckpt"], timeout=120)
    assert proc.returncode != 0 and "checkpoint not found" in proc.stderr
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    proc = python(["-m", "lightning_perf", "generate", "--ckpt_path", bad], timeout=120)
    assert proc.returncode != 0 and "cannot load checkpoint" in proc.stderr and "bad.ckpt" in proc.stderr


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    main_cmd, test_cmd = blocks[0].strip(), blocks[1].strip()
    assert main_cmd.endswith("lightning-perf fit") and "torch==2.13.0" in main_cmd
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [test_cmd]


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_parses_and_builds_its_strategy(recipe, tmp_path):
    """Each shipped recipe, by name, passes the CLI's type checks (``--print_config``), and its
    strategy, when one of ours, constructs from the recipe's arguments (layout and option checks)."""
    import importlib

    import yaml

    path = recipe_dir() / f"{recipe}.yaml"
    proc = _run(["fit", "--config", recipe, "--print_config"], tmp_path, timeout=300)
    assert "model:" in proc.stdout
    recipe_args = yaml.safe_load(path.read_text())
    # the module builds from the recipe's arguments (preset + overrides validated; the GPT is built later)
    from lightning_perf.models import GPT, GPTConfig, GPTLightningModule

    model_args = dict(recipe_args.get("model", {}))
    if model_args.get("init_from_hf"):  # a stand-in Hugging Face folder of the same family
        GPT(GPTConfig.from_name("tiny-llama", n_layer=1, n_embd=64)).save_hf(tmp_path / "hf")
        model_args["init_from_hf"] = str(tmp_path / "hf")
    module = GPTLightningModule(**model_args)
    for field, value in (recipe_args.get("model", {}).get("config_overrides") or {}).items():
        assert getattr(module.config, field) == value
    strategy = recipe_args.get("trainer", {}).get("strategy")
    if isinstance(strategy, dict) and strategy.get("class_path", "").startswith("lightning_perf."):
        module, _, name = strategy["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        built = cls(**strategy.get("init_args", {}))
        assert type(built).__name__ == name


def _fails(args, cwd, timeout=300):
    proc = python(["-m", "lightning_perf", *args], cwd=cwd, timeout=timeout)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def test_default_recipe_applies_only_without_config(tmp_path):
    shown = yaml.safe_load(_run(["fit", "--config", "gpt2-124m", "--print_config"], tmp_path).stdout)
    assert shown["trainer"]["default_root_dir"] == "runs/gpt2-124m"
    assert not shown["trainer"].get("logger")  # the default recipe's CSV / TensorBoard loggers stay out
    callbacks = [c["class_path"].rsplit(".", 1)[-1] for c in shown["trainer"].get("callbacks") or []]
    recipe = yaml.safe_load((recipe_dir() / "gpt2-124m.yaml").read_text())
    assert callbacks == [c["class_path"].rsplit(".", 1)[-1] for c in recipe["trainer"]["callbacks"]]
    assert "MFUMonitor" not in callbacks  # the default recipe's callbacks stay out
    default = yaml.safe_load(_run(["fit", "--print_config"], tmp_path).stdout)
    assert default["trainer"]["default_root_dir"] == "runs/gpt-tiny-cpu" and len(default["trainer"]["logger"]) == 2


def test_default_recipe_follows_default_root_dir(tmp_path):
    out = _run(["fit", "--trainer.default_root_dir", "elsewhere/run1", "--trainer.max_steps", "2",
                "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--data.seq_len", "32",
                "--data.batch_size", "2", "--data.builtin_max_bytes", "100000", "--trainer.enable_progress_bar",
                "false"], tmp_path).stdout
    assert not (tmp_path / "runs").exists()
    run = tmp_path / "elsewhere" / "run1"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "csv" / "version_0" / "metrics.csv").is_file()
    assert "lightning-perf: wrote" in out and "elsewhere/run1/checkpoints" in out and "perf_report.md" in out


def test_errors_name_what_exists(tmp_path):
    err = _fails(["fit", "--config", "gpt2-125m"], tmp_path)
    assert "Did you mean gpt2-124m" in err and "gpt-1.3b-zero3" in err
    err = _fails(["fit", "--trainer.strategy", "zero4"], tmp_path)
    assert "unknown strategy 'zero4'" in err and "zero3" in err and "parallel3d" in err
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_step: 2\n")
    err = _fails(["fit", "--config", "typo.yaml"], tmp_path)
    assert "did you mean trainer.max_steps" in err and len(err.splitlines()) <= 8
    err = _fails(["fit", "--trainer.stratgy", "zero3"], tmp_path)
    assert "did you mean trainer.strategy" in err and "usage" not in err
    err = _fails(["fitt"], tmp_path)
    assert "Did you mean fit?" in err


def test_help_lists_every_subcommand_and_recipe(tmp_path):
    out = _run(["--help"], tmp_path).stdout
    for word in ("fit", "validate", "test", "predict", "generate", "prepare", "consolidate", "convert", *recipe_names()):
        assert word in out


def test_precision_becomes_perf_precision_where_a_generic_plugin_runs():
    from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

    from lightning_perf.plugins import PerfPrecision

    swapped = perf_precision_for({"precision": "bf16-mixed", "strategy": "auto"})
    assert swapped["precision"] is None and isinstance(swapped["plugins"][0], PerfPrecision)
    assert swapped["plugins"][0].precision == "bf16-mixed"
    assert perf_precision_for({"precision": 16, "strategy": "ddp"})["plugins"][0].precision == "16-mixed"
    assert perf_precision_for({"precision": "32-true", "strategy": SingleDeviceStrategy("cpu")})
    assert perf_precision_for({"precision": "bf16-mixed", "strategy": "zero3"})
    # strategies with their own plugins, precisions PerfPrecision lacks, a plugin already given: unchanged
    assert perf_precision_for({"precision": "bf16-mixed", "strategy": FSDPStrategy()}) == {}
    assert perf_precision_for({"precision": "bf16-mixed", "strategy": "deepspeed"}) == {}
    assert perf_precision_for({"precision": "64-true", "strategy": "auto"}) == {}
    assert perf_precision_for({"precision": "bf16-mixed", "plugins": [PerfPrecision("32-true")]}) == {}
