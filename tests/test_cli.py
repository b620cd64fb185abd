"""The command line: a real `fit` subprocess on the tiny recipe, then `generate` from its checkpoint."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "lightning_perf", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    _run(["fit", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1",
          "--data.seq_len", "32", "--data.batch_size", "2", "--data.builtin_max_bytes", "100000",
          "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1"], cwd)
    return cwd


def test_fit_writes_checkpoint_and_logs(fitted):
    run = fitted / "runs" / "gpt-tiny-cpu"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    metrics = (run / "csv" / "version_0" / "metrics.csv").read_text()
    assert "train/loss" in metrics and "val/loss" in metrics
    assert any((run / "tensorboard").rglob("events.out.tfevents.*"))


def test_generate_from_checkpoint(fitted):
    ckpt = fitted / "runs" / "gpt-tiny-cpu" / "checkpoints" / "last.ckpt"
    out = _run(["generate", "--ckpt_path", str(ckpt), "--prompt", "def main(", "--max_new_tokens", "12",
                "--device", "cpu"], fitted).stdout
    assert out.startswith("def main(")


def test_generate_refuses_missing_and_corrupt_checkpoints(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_perf", "generate", "--ckpt_path", str(tmp_path / "no.ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "checkpoint not found" in proc.stderr
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    proc = subprocess.run([sys.executable, "-m", "lightning_perf", "generate", "--ckpt_path", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "cannot load checkpoint" in proc.stderr and "bad.ckpt" in proc.stderr


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    main_cmd, test_cmd = blocks[0].strip(), blocks[1].strip()
    assert main_cmd.endswith("lightning-perf fit") and "torch==2.13.0" in main_cmd
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [test_cmd]


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_recipe_parses_and_builds_its_strategy(recipe, tmp_path):
    """Each recipe in configs/ passes the CLI's type checks (``--print_config``), and its strategy,
    when one of ours, constructs from the recipe's arguments (layout and option checks included)."""
    import importlib

    import yaml

    path = ROOT / "configs" / recipe
    proc = _run(["fit", "--config", str(path), "--print_config"], tmp_path, timeout=300)
    assert "model:" in proc.stdout
    recipe_args = yaml.safe_load(path.read_text())
    # the module builds from the recipe's arguments (preset + overrides validated; the GPT is built later)
    from lightning_perf.models import GPTLightningModule

    module = GPTLightningModule(**recipe_args.get("model", {}))
    for field, value in (recipe_args.get("model", {}).get("config_overrides") or {}).items():
        assert getattr(module.config, field) == value
    strategy = recipe_args.get("trainer", {}).get("strategy")
    if isinstance(strategy, dict) and strategy.get("class_path", "").startswith("lightning_perf."):
        module, _, name = strategy["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        built = cls(**strategy.get("init_args", {}))
        assert type(built).__name__ == name
