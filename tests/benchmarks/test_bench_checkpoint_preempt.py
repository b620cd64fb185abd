"""``bench_checkpoint.py --preempt --smoke``: two gloo rank processes SIGTERMed after warm-up leave with 143, and
the JSON holds each rank's seconds from the signal to its stop and to its exit, and the checkpoint it verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_preempt_smoke_times_sigterm_to_exit(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_checkpoint.py"), "--preempt", "--smoke",
                           "--out", str(tmp_path), "--dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = tmp_path.glob("bench_checkpoint_preempt_cpu_smoke_*.json")
    preempt = json.loads(result.read_text())["preempt"]
    assert preempt["all_exited_with_143"], preempt
    ranks = preempt["ranks"]
    assert sorted(ranks) == ["0", "1"]
    step = ranks["0"]["step"]
    for row in ranks.values():
        assert row["exit_code"] == 143 and row["step"] == step and row["error"] is None, row
        assert 0 < row["stop_s"] <= row["exit_s"] <= preempt["seconds_to_exit"], row
    assert preempt["checkpoint"]["verified"] and preempt["checkpoint"]["step"] == step > 3  # after the warm-up
