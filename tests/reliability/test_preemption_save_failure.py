"""A preemption whose checkpoint write fails still ends with a checkpoint of its step, or at least with the
preemption's way out: two gloo ranks, ZeRO-3, saves in the background (``_preempt_faults``).

SIGTERM to rank 0 at step 2; the ranks stop at step 4. DCP's write of the shards fails with
"CUDA error: out of memory":

- in the writer thread of rank 1 only, or of both ranks: the ranks agree that the save failed, write
  it again in the foreground, and exit with 143; the checkpoint holds step 4, equal (parameters,
  AdamW's state, step) to the uninterrupted run's checkpoint of step 4, and resuming from it ends
  equal to the uninterrupted run's final checkpoint;
- in every thread of rank 1 (the retry fails too): both ranks still exit with 143, at once (not after
  the collective timeout), reporting that no checkpoint of step 4 was written; ``last.ckpt`` is the
  intact save of step 3, and resuming from it ends equal to the uninterrupted run.

And in one process: the writer thread sets the rank's device before anything else and makes no CUDA
call (DCP's writer would read a CUDA stream, where CUDA exists, if it copied ahead from a device).
"""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from _harness import launch
from _preempt_faults import SCENARIOS, STEPS, STOP, assert_same_state, interrupted, reference, resumed

TIMEOUT = 60.0  # the strategy's collective timeout: a failed save must not make any rank wait for it


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preempt_fail")
    launch(reference, 2, root / "out_ref", root, "cpu", TIMEOUT, timeout=180).check_ok()
    got = {}
    for name in SCENARIOS:
        outcome = launch(interrupted, 2, root / f"out_{name}", root, name, "cpu", TIMEOUT, timeout=180)
        stop_ckpt = root / f"{name}_stop"  # the checkpoint the stop left, before the resumed run overwrites it
        if (root / name / "last.ckpt").exists():
            shutil.copytree(root / name / "last.ckpt", stop_ckpt)
        got[name] = {"outcome": outcome, "stop_ckpt": stop_ckpt,
                     "names": sorted(p.name for p in (root / name).iterdir())}
    resumed_out = launch(resumed, 2, root / "out_resumed", root, "cpu", TIMEOUT, timeout=240)
    return {"root": root, "got": got, "resumed": resumed_out.check_ok()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_exits_with_the_preemption_status(runs, name) -> None:
    outcome = runs["got"][name]["outcome"]
    assert outcome.exitcodes == [128 + signal.SIGTERM] * 2, (outcome.exitcodes, outcome.errors)
    stops = [r["stopped"] for r in outcome.results]
    assert all(s is not None and s["step"] == STOP and s["signum"] == signal.SIGTERM for s in stops), stops
    signal_time = outcome.results[0]["signal_time"]
    for s in stops:  # both ranks left within seconds of the signal: no rank waited for the collective timeout
        assert s["time"] - signal_time < TIMEOUT / 3, (s["time"] - signal_time, stops)


@pytest.mark.parametrize("name", ["writer_fails_on_rank1", "writer_fails_on_both"])
def test_failed_background_write_is_saved_again_at_the_stop_step(runs, name) -> None:
    got = runs["got"][name]
    for r in got["outcome"].results:
        assert r["stopped"]["path"].endswith("last.ckpt") and r["stopped"]["error"] is None, r["stopped"]
    assert not any(n.endswith((".old", ".del")) for n in got["names"]), got["names"]
    root = runs["root"]
    assert_same_state(got["stop_ckpt"], root / "reference" / f"epoch=0-step={STOP}.ckpt")


def test_a_save_that_fails_everywhere_leaves_the_previous_checkpoint(runs) -> None:
    got = runs["got"]["every_write_fails_on_rank1"]
    for r in got["outcome"].results:
        assert r["stopped"]["path"] is None, r["stopped"]
        assert "out of memory" in r["stopped"]["error"] and "foreground" in r["stopped"]["error"], r["stopped"]
    log = (runs["root"] / "out_every_write_fails_on_rank1" / "rank0.log").read_text()
    assert f"stopped at global step {STOP} WITHOUT a checkpoint of it" in log, log[-3000:]
    assert_same_state(got["stop_ckpt"], runs["root"] / "reference" / f"epoch=0-step={STOP - 1}.ckpt")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_after_the_stop_ends_equal_to_the_uninterrupted_run(runs, name) -> None:
    start = STOP - 1 if name == "every_write_fails_on_rank1" else STOP
    for r in runs["resumed"]:
        assert r[name] == {"global_step": STEPS, "first_step": start}, r[name]
    root = runs["root"]
    assert_same_state(root / name / "last.ckpt", root / "reference" / f"epoch=0-step={STEPS}.ckpt")


# ---- the writer thread --------------------------------------------------------------------------


def test_writer_thread_binds_the_device_and_makes_no_cuda_call(tmp_path, monkeypatch) -> None:
    from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointer
    from lightning_perf.parallel.checkpointing.checkpoint import load_checkpoint

    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append((threading.current_thread().name, d)))
    saver = AsyncCheckpointer(device=torch.device("cuda", 1))
    # from here on CUDA "exists" for the writer thread: DCP's writer would then copy ahead on a CUDA stream
    # (torch.cuda.current_stream, which this CPU build cannot run) unless told to read host tensors as they are
    monkeypatch.setattr(torch.cuda, "is_available", lambda: threading.current_thread() is not threading.main_thread())
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saver.save(tmp_path / "ckpt", model, [opt], extra={"step": 1})
    assert saver.wait() == tmp_path / "ckpt"
    saver.close()
    monkeypatch.undo()
    assert len(bound) == 1 and bound[0][1] == torch.device("cuda", 1), bound
    assert bound[0][0].startswith("lightning_perf_ckpt"), bound  # in the writer thread, before it wrote
    fresh = torch.nn.Linear(4, 4)
    assert load_checkpoint(tmp_path / "ckpt", fresh) == {"step": 1}
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)
