"""A run's first and last minutes (``benchmarks/_phases.py``, ``bench_recipes.py``): the marks a fit writes
come in the order the Trainer passes its phases and are on disk once the first step is done; the
durations are the differences of those marks; a process's start comes from the OS; and a recipe run
twice against the same caches reports both runs' startup and exit."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _phases
import bench_recipes
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]

# the marks of one fit, in the order the Trainer reaches them
FIT_ORDER = ("trainer_built", "environment_ready", "configure_model_start", "model_built", "optimizers_built",
             "strategy_setup_done", "train_start", "first_step_start", "first_step_end", "second_step_end",
             "third_step_end", "last_step_end", "train_end_done", "fit_end_done", "trainer_teardown")


def test_phases_are_the_differences_of_the_marks():
    marks = {"process_start": 100.0, "imports_done": 103.0, "trainer_built": 103.5, "environment_ready": 104.0,
             "configure_model_start": 104.25, "model_built": 106.0, "strategy_setup_done": 106.5,
             "first_step_start": 107.0, "first_step_end": 150.0, "second_step_end": 151.0,
             "last_step_end": 160.0, "train_end_done": 161.0, "trainer_teardown": 161.5, "process_exit": 164.0}
    got = _phases.phases(marks)
    assert got["start_to_first_step_s"] == 50.0 and got["start_to_first_step_start_s"] == 7.0
    assert got["last_step_to_exit_s"] == 4.0
    assert (got["imports_s"], got["cli_s"], got["environment_s"], got["model_build_s"]) == (3.0, 0.5, 0.5, 1.75)
    assert (got["strategy_setup_s"], got["to_first_step_s"], got["first_step_s"], got["second_step_s"]) == (
        0.5, 0.5, 43.0, 1.0)
    assert (got["train_end_s"], got["teardown_s"], got["process_exit_s"]) == (1.0, 0.5, 2.5)
    assert got["at_s"]["first_step_end"] == 50.0 and list(got["at_s"])[0] == "process_start"
    # a run killed before its end: the spans it did not reach are left out, none made up
    cut = _phases.phases({k: v for k, v in marks.items() if v <= 150.0})
    assert cut["start_to_first_step_s"] == 50.0
    assert not {"last_step_to_exit_s", "train_end_s", "teardown_s", "process_exit_s"} & set(cut)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="process start times come from Linux's /proc")
def test_process_start_time_is_when_the_process_started():
    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    after = time.time()
    try:
        time.sleep(0.5)
        started = _phases.process_start_time(proc.pid)
    finally:
        proc.wait()
    assert started is not None
    assert before - 0.05 <= started <= after + 0.05  # one clock tick (10 ms) of resolution, and the reads
    assert _phases.process_start_time() <= time.time() - 0.0


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = None

    def configure_model(self) -> None:
        if self.layer is None:
            self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ReadsMarksAfterFirstStep(L.Callback):
    """What is on disk when the second step starts."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            self.seen = json.loads(self.path.read_text())


def test_phase_times_marks_a_fit_in_order_and_write_after_the_first_step(tmp_path, monkeypatch):
    out = tmp_path / "phases.json"
    monkeypatch.setattr(_phases, "MARKS", {"imports_done": time.time()})
    profiler = _phases.PhaseTimes(out=str(out))
    reader = _ReadsMarksAfterFirstStep(out)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        profiler=profiler, callbacks=[reader])
    trainer.fit(_Regression(), DataLoader(data, batch_size=4))
    # the first step's end was on disk before the second step started (kept should the run die later)
    assert "first_step_end" in reader.seen["marks"] and "last_step_end" in reader.seen["marks"]
    assert "train_end_done" not in reader.seen["marks"]
    written = json.loads(out.read_text())
    marks = written["marks"]
    assert written["steps"] == 5 and written["checkpoint_save_s"] == 0.0
    assert [marks[k] for k in FIT_ORDER] == sorted(marks[k] for k in FIT_ORDER), marks
    assert marks["imports_done"] <= marks["trainer_built"]  # this process's own marks join the Trainer's
    if _phases.process_start_time() is not None:
        assert marks["process_start"] <= marks["imports_done"]
    spans = _phases.phases(marks)
    assert spans["first_step_s"] >= 0 and spans["model_build_s"] >= 0 and "process_exit_s" not in spans


class _SlowValidation(_Regression):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.05)


def test_validation_and_checkpoints_are_timed_beside_the_marks(tmp_path):
    out = tmp_path / "phases.json"
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, val_check_interval=2,
                        limit_val_batches=3, num_sanity_val_steps=1, profiler=_phases.PhaseTimes(out=str(out)),
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(_SlowValidation(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    written = json.loads(out.read_text())
    # the sanity check's one batch before the first step, the three batches after the last
    assert 0.05 <= written["sanity_validation_s"] < written["validation_s"] and written["validation_s"] >= 0.15
    assert written["checkpoint_save_s"] > 0
    marks = written["marks"]
    assert marks["last_step_end"] + written["validation_s"] <= marks["train_end_done"]
    assert marks["train_start"] - marks["strategy_setup_done"] >= written["sanity_validation_s"]


def test_startup_record_adds_the_parents_launch_and_exit(tmp_path):
    path = tmp_path / "x.phases"
    path.write_text(json.dumps({"marks": {"process_start": 10.0, "first_step_end": 40.0, "last_step_end": 70.0,
                                          "trainer_teardown": 71.0}, "steps": 30, "checkpoint_save_s": 0.0}))
    record = bench_recipes.startup_record(path, launched=9.99, exited=72.5)
    assert record["start_to_first_step_s"] == 30.0 and record["last_step_to_exit_s"] == 2.5
    assert record["process_exit_s"] == 1.5 and record["steps_seen"] == 30
    # killed at a timeout: no exit is made up
    assert "last_step_to_exit_s" not in bench_recipes.startup_record(path, launched=9.99, exited=None)
    assert bench_recipes.startup_record(tmp_path / "missing", launched=1.0, exited=2.0) == {}


def test_no_checkpoint_takes_the_recipes_checkpoint_callbacks_out(tmp_path):
    recipe = bench_recipes._recipe("gpt-1.3b-fp8")
    assert any("ModelCheckpoint" in c["class_path"] for c in recipe["trainer"]["callbacks"])
    import yaml

    written = yaml.safe_load(bench_recipes._without_checkpoints(recipe, tmp_path / "r.yaml").read_text())
    assert not any("ModelCheckpoint" in c["class_path"] for c in written["trainer"]["callbacks"])
    assert written["model"] == recipe["model"] and written["data"] == recipe["data"]


def test_bench_recipes_reports_cold_and_warm_startup(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_recipes.py"), "--smoke", "--recipes", "gpt-tiny-cpu",
         "--steps", "2", "--warmup", "1", "--no_baseline", "--warm_cache", "--no_checkpoint", "--no_validation",
         "--out", str(tmp_path), "--cache_root", str(tmp_path / "caches")],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("bench_recipes_cpu_*.json")
    row = json.loads(result.read_text())["rows"][0]
    assert row["baselines"] == [] and "plain" not in row
    for run in ("recipe", "recipe_warm"):
        startup = row[run]["startup"]
        assert startup["start_to_first_step_s"] > startup["imports_s"] > 0
        assert startup["last_step_to_exit_s"] >= startup["process_exit_s"] >= 0
        assert startup["steps_seen"] == 3 and "tokens_per_s" in row[run]
    # both runs used the same caches, under the folder given; no child's scratch file is left in --out
    assert any((tmp_path / "caches" / "recipe-gpt-tiny-cpu").iterdir())
    assert not list(tmp_path.glob("_*")), list(tmp_path.glob("_*"))


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads Linux's /proc")
def test_what_a_child_leaves_running_after_its_exit_is_listed_and_killed():
    code = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    proc.wait()
    left = bench_recipes._kill_session(proc.pid)
    assert len(left) == 1 and "time.sleep(120)" in left[0]
    deadline = time.time() + 10
    while bench_recipes._kill_session(proc.pid) and time.time() < deadline:  # killed: gone once the OS says so
        time.sleep(0.05)
    assert bench_recipes._kill_session(proc.pid) == []
