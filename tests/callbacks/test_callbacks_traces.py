"""RooflineMonitor(traces=True): the profiled steps saved as a Chrome trace and a TensorBoard trace
next to the report, both readable, holding the ops of exactly the profiled steps."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from callback_toys import trainer
from lightning_perf.callbacks import PerfReport, RooflineMonitor
from lightning_perf.perf.trace import load_trace
from test_callbacks_roofline import PEAKS, MatmulToy, _data

WIDTH = 32
MM_PER_STEP = 4 + 7  # 4 linears forward; backward: 4 weight grads + 3 input grads


def _mm_events(path: str) -> int:
    events = load_trace(path)["traceEvents"]
    return sum(1 for e in events if e.get("name") == "aten::mm" and e.get("ph") == "X")


def test_profiled_window_is_saved_as_chrome_and_tensorboard_traces(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    mon = RooflineMonitor(start_step=1, profile_steps=2, traces=True, **PEAKS)
    report = PerfReport(print_report=False)
    trainer(tmp_path, [mon, report], max_steps=5, logger=logger).fit(MatmulToy(WIDTH), _data((WIDTH, WIDTH), n=8))
    log_dir = logger.log_dir
    chrome = os.path.join(log_dir, "trace_step2-3.json.gz")
    [board] = [os.path.join(log_dir, "tb_trace", f) for f in os.listdir(os.path.join(log_dir, "tb_trace"))]
    assert os.path.basename(board).startswith("rank0.") and board.endswith(".pt.trace.json.gz")
    assert mon.trace_files == [chrome, board]
    assert os.path.dirname(report.files[0]) == log_dir  # beside perf_report.md
    # the counted step (1) is not in the trace; the two profiled steps (2, 3) are, each with its matmuls
    assert _mm_events(chrome) == _mm_events(board) == 2 * MM_PER_STEP
    assert mon.sampled_steps == [1, 2, 3]
    [result] = mon.results
    assert result["step"] == 1 and result["profiled_steps"] == [2, 3]
    assert {g["name"]: g for g in result["categories"]}["matmul"]["flops"] == MM_PER_STEP * 2 * WIDTH**3


def test_traces_without_peaks_profile_the_start_step_only(tmp_path):
    mon = RooflineMonitor(start_step=2, traces=True)
    with pytest.warns(UserWarning, match="saving traces only"):
        trainer(tmp_path, [mon], max_steps=4).fit(MatmulToy(WIDTH), _data((WIDTH, WIDTH)))
    assert mon.results == [] and mon.sampled_steps == [2]
    chrome = os.path.join(str(tmp_path), "trace_step2.json.gz")
    assert chrome in mon.trace_files and _mm_events(chrome) == MM_PER_STEP


def test_profile_steps_must_fit_between_samples():
    with pytest.raises(ValueError, match="every_n_steps"):
        RooflineMonitor(every_n_steps=2, profile_steps=2)
