"""``lightning-perf fit`` of the tiny CPU recipe, stopped by SIGTERM mid-run: it saves the step it stopped at
and exits 143, and ``--ckpt_path last`` continues from that step, not from step 0."""

from __future__ import annotations

import csv
import os
import re
import signal
import time
from pathlib import Path

import torch
from _warm import python, start

FIT = ["-m", "lightning_perf", "fit", "--data.seq_len", "32", "--data.batch_size", "2",
       "--data.builtin_max_bytes", "100000", "--trainer.enable_progress_bar", "false",
       "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "5000"]


def _logged_steps(metrics: Path) -> list[int]:
    with metrics.open() as f:
        return sorted(int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss"))


def test_sigterm_saves_the_step_and_ckpt_path_last_continues_from_it(tmp_path) -> None:
    marker = tmp_path / "marker"  # a second, weights-only ModelCheckpoint: shows that training has begun
    run = start([*FIT, "--trainer.max_steps", "5000", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                 f"--trainer.callbacks.dirpath={marker}", "--trainer.callbacks.every_n_train_steps=3",
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
