"""How the ``lightning-perf`` command's process ends (``lightning_perf.cli.shutdown.end_process``): without the
interpreter's teardown, but with everything that teardown would have done outside the process: threads
that are not daemons finish, exit handlers run, files left open get their buffered writes, the exit status
is the one asked for; and a fit through the command leaves complete logs and checkpoints."""

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), LIGHTNING_PERF_CACHE_DIR=os.environ.get("TMPDIR", "/tmp"))


def test_end_process_does_what_the_exit_would_outside_the_process(tmp_path):
    code = textwrap.dedent(f'''
        import atexit, sys, threading, time
        from pathlib import Path
        import triton._C.libtriton  # a nanobind module: its leak check would speak at a teardown that froze objects
        from lightning_perf.cli.shutdown import end_process

        out = Path({str(tmp_path)!r})
        left_open = open(out / "open.txt", "w")  # never closed, in a reference cycle
        left_open.write("x" * 100 + "\\n")
        holder = {{"file": left_open}}
        holder["self"] = holder
        del left_open, holder

        def late_writer():
            time.sleep(0.3)
            (out / "thread.txt").write_text("done")

        threading.Thread(target=late_writer).start()
        atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
        sys.stdout.write("no newline at the end")
        end_process(3)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert (tmp_path / "open.txt").read_text() == "x" * 100 + "\n"
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert proc.stdout.endswith("no newline at the end")
    assert "nanobind" not in proc.stderr and "leaked" not in proc.stderr


def test_a_fit_through_the_command_leaves_complete_logs_and_checkpoints(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_perf", "fit", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
         "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "lightning-perf: wrote" in proc.stdout and "leaked" not in proc.stderr
    root = tmp_path / "runs" / "gpt-tiny-cpu"
    (metrics,) = root.glob("csv/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss")) == [0, 1, 2]  # every step reached the file
    assert list(root.glob("tensorboard/version_*/events.out.tfevents.*"))
    state = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 3
    assert list(root.glob("csv/version_*/perf_report.md"))
