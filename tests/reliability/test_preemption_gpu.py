"""On GPUs: a preemption while the card is full (all but 256 MiB taken) still ends with a checkpoint of its
step, written in the background (``_preempt_faults``, nothing planted).

One rank per GPU, two where there are two (where a writer thread that did not set its device would
create a context on the other rank's full card and fail with "CUDA error: out of memory"), NCCL,
ZeRO-3 with saves in the background and their staging buffers reserved after the first step. SIGTERM
at step 2: every rank exits with 143 and the checkpoint of step 4 equals (parameters, AdamW's state,
step) the uninterrupted run's; resuming from it ends equal to the uninterrupted run's final state.
Run with ``pytest -m gpu tests/reliability/test_preemption_gpu.py`` (about 30 s).
"""

from __future__ import annotations

import shutil
import signal

import pytest
import torch
from _harness import launch
from _preempt_faults import FULL_GPU, LEFT_FREE, STEPS, STOP, after, assert_same_state, interrupted

TIMEOUT = 60.0


@pytest.mark.gpu
def test_preemption_on_a_full_gpu_saves_the_stop_step_and_resumes_exactly(tmp_path) -> None:
    world = min(2, torch.cuda.device_count())
    free, _ = torch.cuda.mem_get_info(device="cuda")
    assert free > LEFT_FREE  # each rank fills its card to LEFT_FREE
    stopped = launch(interrupted, world, tmp_path / "out_stop", tmp_path, FULL_GPU, "gpu", TIMEOUT, timeout=120)
    assert stopped.exitcodes == [128 + signal.SIGTERM] * world, (stopped.exitcodes, stopped.errors)
    for r in stopped.results:
        assert r["memory"]["free_after"] <= LEFT_FREE + 2**20 < r["memory"]["free_before"], r["memory"]
        assert r["stopped"]["step"] == (STOP if world == 2 else STOP - 1), r["stopped"]
        assert r["stopped"]["path"].endswith("last.ckpt") and r["stopped"]["error"] is None, r["stopped"]
    step = stopped.results[0]["stopped"]["step"]
    shutil.copytree(tmp_path / FULL_GPU / "last.ckpt", tmp_path / "stop")  # the resumed run overwrites last.ckpt
    resumed = launch(after, world, tmp_path / "out_after", tmp_path, "gpu", TIMEOUT, [FULL_GPU], timeout=120)
    for r in resumed.check_ok():
        assert r[FULL_GPU] == {"global_step": STEPS, "first_step": step}, r
    assert_same_state(tmp_path / "stop", tmp_path / "reference" / f"epoch=0-step={step}.ckpt")
    assert_same_state(tmp_path / FULL_GPU / "last.ckpt", tmp_path / "reference" / f"epoch=0-step={STEPS}.ckpt")
