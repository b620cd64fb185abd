"""``lightning-perf fit`` of the tiny CPU recipe, stopped by SIGTERM mid-run: it saves the step it stopped at
and exits 143, and ``--ckpt_path last`` continues from that step, not from step 0. The same for every
multi-process layout of the shipped recipes on the CPU (ZeRO-3 and a pipeline, slow), the signal sent to the
launching process only. Every recipe attaches the same callback through the same CLI and strategy code
(``tests/test_recipes.py`` runs each one through ``lightning-perf fit``); the two layouts here are the ones
whose ranks must agree on the step."""

from __future__ import annotations

import csv
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from _warm import python, start

from lightning_perf.cli import recipe_names

FIT = ["-m", "lightning_perf", "fit", "--data.seq_len", "32", "--data.batch_size", "2",
       "--data.builtin_max_bytes", "100000", "--trainer.enable_progress_bar", "false",
       "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "5000"]


def _logged_steps(metrics: Path) -> list[int]:
    with metrics.open() as f:
        return sorted(int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss"))


def test_sigterm_saves_the_step_and_ckpt_path_last_continues_from_it(tmp_path) -> None:
    marker = tmp_path / "marker"  # a second, weights-only ModelCheckpoint: shows that training has begun
    run = start([*FIT, "--trainer.max_steps", "5000",
                 "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={marker}", "--trainer.callbacks.every_n_train_steps=3",
                 "--trainer.callbacks.save_weights_only=true", "--trainer.callbacks.save_top_k=-1"], cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not list(marker.glob("*step=3.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(run._proc.pid, signal.SIGTERM)
    first = run.finish(300)
    out = first.stdout + first.stderr
    assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
    found = re.search(r"lightning_perf: SIGTERM received; stopped at global step (\d+) with the checkpoint (\S+) "
                      r"\(final\); exiting with code 143", out)
    assert found, out[-3000:]
    step, path = int(found.group(1)), Path(found.group(2))
    checkpoints = tmp_path / "runs" / "gpt-tiny-cpu" / "checkpoints"
    assert step >= 3 and path == (checkpoints / "last.ckpt").resolve()
    assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] == step
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]  # the recipe saves every 100 steps

    second = python([*FIT, "--trainer.max_steps", str(step + 2), "--ckpt_path", "last"], cwd=tmp_path, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    # the second run trained the two steps after the checkpoint and no others
    assert _logged_steps(tmp_path / "runs" / "gpt-tiny-cpu" / "csv" / "version_1" / "metrics.csv") == [step, step + 1]
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == step + 2


# ---- every shipped recipe (slow: each in its own layout, up to 8 CPU ranks) ------------------------


def _recipe_stand_in(name: str, side: Path) -> tuple[Path, Path]:
    """The recipe on the CPU as ``tests/test_recipes.py`` runs it, training on until stopped; its checkpoint
    every 1000 steps (so the only one is the signal's), a weights-only one each step in ``marker``."""
    import yaml
    from test_recipes import _stand_in

    from lightning_perf.cli import recipe_dir

    recipe = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    root = Path(recipe["trainer"]["default_root_dir"])
    config = _stand_in(recipe, side)
    config["trainer"].update(max_steps=1000, val_check_interval=1000)
    callbacks = [dict(c, init_args={**(c.get("init_args") or {}), "every_n_train_steps": 1000})
                 if "ModelCheckpoint" in c.get("class_path", "") else c for c in config["trainer"]["callbacks"]]
    marker = root / "marker"
    callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                      "init_args": {"dirpath": str(marker), "every_n_train_steps": 1, "save_top_k": -1,
                                    "save_weights_only": True}})
    config["trainer"]["callbacks"] = callbacks
    path = side / "cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, marker


# one ZeRO-3 recipe and one pipeline recipe: the layouts in which ranks other than the signalled one must stop
LAYOUT_RECIPES = [n for n in ("gpt-1.3b-zero3", "gpt-1.3b-pp2") if n in recipe_names()]


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUT_RECIPES)
def test_every_recipe_stops_on_sigterm_with_a_checkpoint_that_last_resumes(name, tmp_path) -> None:
    from lightning_perf.runtime.resume import checkpoint_step

    cwd, side = tmp_path / "run", tmp_path / "side"
    cwd.mkdir()
    side.mkdir()
    stand_in, marker = _recipe_stand_in(name, side)
    run = start(["-m", "lightning_perf", "fit", "--config", name, "--config", stand_in], cwd=cwd)
    deadline = time.monotonic() + 240
    while not list((cwd / marker).glob("*step=1.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(run._proc.pid, signal.SIGTERM)  # the launching process (rank 0) only: the ranks agree
    first = run.finish(240)
    out = first.stdout + first.stderr
    assert first.returncode != 0, out[-3000:]
    found = re.search(r"stopped at global step (\d+) with the checkpoint (\S+) \(final\)", out)
    assert found, out[-4000:]
    step, path = int(found.group(1)), Path(found.group(2))
    assert step >= 1 and path.name == "last.ckpt" and checkpoint_step(path) == step
    second = python(["-m", "lightning_perf", "fit", "--config", name, "--config", stand_in, "--trainer.max_steps",
                     str(step + 1), "--ckpt_path", "last"], cwd=cwd, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert f"Restoring states from the checkpoint path at {path}" in out, out[-3000:]
    assert checkpoint_step(path) == step + 1
