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
from _preempt_faults import SCENARIOS, STEPS, STOP, after, assert_same_state, interrupted

TIMEOUT = 60.0  # the strategy's collective timeout: a failed save must not make any rank wait for it


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preempt_fail")
    got = {}
    for name in SCENARIOS:
        outcome = launch(interrupted, 2, root / f"out_{name}", root, name, "cpu", TIMEOUT, timeout=180)
        stop_ckpt = root / f"{name}_stop"  # the checkpoint the stop left, before the resumed run overwrites it
        if (root / name / "last.ckpt").exists():
            shutil.copytree(root / name / "last.ckpt", stop_ckpt)
        got[name] = {"outcome": outcome, "stop_ckpt": stop_ckpt,
                     "names": sorted(p.name for p in (root / name).iterdir())}
    resumed = launch(after, 2, root / "out_after", root, "cpu", TIMEOUT, list(SCENARIOS), timeout=300)
    return {"root": root, "got": got, "resumed": resumed.check_ok()}


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


# ---- SLURM: the requeue survives a failed save --------------------------------------------------


def _slurm(rank: int, world: int, out: Path, root: Path, where: str) -> None:
    """One process under ``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 at step 2 and DCP's writes failing from
    then on (``where``); a stand-in ``scontrol`` records its arguments. Leaves by the stop's ``Preempted``."""
    import os

    import lightning as L
    from _harness import data, make_module
    from _preempt_faults import _fail_writes
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_perf.callbacks import Preempted
    from lightning_perf.strategies import ZeroStrategy

    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {root / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    os.environ.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NTASKS="1",
                      SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                      SLURM_NODELIST="localhost", SLURM_JOB_NAME="train")

    def on_step(module, step):
        if step == 2:
            module.trainer.strategy.wait_for_checkpoint()  # step 2's save is final before the writes fail
            _fail_writes(where)
            os.kill(os.getpid(), signal.SIGUSR1)

    L.seed_everything(0, verbose=False)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=0,
                                                      save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2, async_checkpoint=True),
                        plugins=[SLURMEnvironment(auto_requeue=True)], max_steps=6, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[checkpoints], default_root_dir=root)
    try:
        trainer.fit(make_module(on_step=on_step), data(4, 1, 64))
    except Preempted as e:
        torch.save({"step": e.step, "path": e.path, "error": e.error}, out / f"rank{rank}.pt")
        raise


@pytest.mark.parametrize("where", ["writer", "always"])
def test_slurm_requeue_runs_when_the_save_fails(tmp_path, where) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import read_extra

    outcome = launch(_slurm, 1, tmp_path / "out", tmp_path, where, timeout=120)
    assert outcome.exitcodes == [128 + signal.SIGUSR1], (outcome.exitcodes, outcome.errors)
    stop = outcome.results[0]
    assert stop["step"] == 3  # one process: the step the signal arrived in
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]  # exactly one requeue
    if where == "writer":  # saved again in the foreground, and so was Lightning's own checkpoint
        assert stop["path"].endswith("last.ckpt") and read_extra(stop["path"])["extra"]["global_step"] == 3
        assert (tmp_path / "hpc_ckpt_1.ckpt").is_dir()
    else:  # nothing of step 3 could be written: last.ckpt is step 2's, intact; Lightning's save failed too
        assert stop["path"] is None and "out of memory" in stop["error"]
        assert read_extra(tmp_path / "ckpt" / "last.ckpt")["extra"]["global_step"] == 2
        assert not (tmp_path / "hpc_ckpt_1.ckpt").exists()
