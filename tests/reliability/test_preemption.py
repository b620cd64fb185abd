"""Preemption: SIGTERM, SIGUSR1 and SIGINT stop every rank at one step with a final checkpoint, and the
run resumed from it continues the loss curve of an uninterrupted run exactly.

Two gloo ranks, the tiny GPT, fp32, ``ModelCheckpoint`` every 100 steps (so the only checkpoint is
the one the signal makes):

- ZeRO-3, saves in the call, ``save_last=True``: SIGTERM to rank 1 only at step 3;
- ZeRO-3, saves in the background, ``save_last="link"``: SIGUSR1 to rank 0 only at step 3;
- ``Parallel3DStrategy`` data parallel over 2 ranks: SIGINT to both ranks at step 3 (a Ctrl-C);

each leaves a final checkpoint of one step >= 3, the same on both ranks, and ``ckpt_path="last"``
resumes it: the losses of the remaining steps equal those of one process that was never stopped.
A signal in the last step is agreed on at the end of the fit, which stops the same way.
One process without a pack strategy (``GPTLightningModule`` on Lightning's single device) the same,
and under ``SLURMEnvironment(auto_requeue=True)`` SIGUSR1 also runs Lightning's requeue (its own
checkpoint and ``scontrol requeue``, here a stand-in ``scontrol`` on the PATH).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from _harness import data, launch, make_module, reference

TIMEOUT = 6.0
GB, SAMPLES, STEPS, K = 4, 64, 8, 3  # global batch, samples per epoch (16 steps), steps, the signal's step


def _strategy(kind: str):
    from datetime import timedelta

    from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

    if kind in ("zero3", "zero3_last"):
        return ZeroStrategy(stage=3, timeout=TIMEOUT, async_checkpoint=False)
    if kind == "zero3_async":
        return ZeroStrategy(stage=3, timeout=TIMEOUT, async_checkpoint=True)
    return Parallel3DStrategy(data_parallel_size=2, zero_stage=2, timeout=timedelta(seconds=TIMEOUT))


SAVE_LAST = {"zero3": True, "zero3_async": "link", "dp2": True}


def _fit(kind: str, world: int, root: Path, module, *, ckpt_path=None, strategy=None, plugins=None) -> dict:
    """Fit until ``STEPS`` or a signal; what it saw."""
    import lightning as L

    from lightning_perf.callbacks import Preempted

    save_last = SAVE_LAST.get(kind, True)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / kind, every_n_train_steps=100,
                                                      save_top_k=1 if save_last == "link" else 0, save_last=save_last)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy or _strategy(kind), max_steps=STEPS,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[checkpoints], plugins=plugins, default_root_dir=root)
    stopped = None
    try:
        trainer.fit(module, data(GB, world, SAMPLES), ckpt_path=ckpt_path)
    except Preempted as e:
        stopped = {"signum": e.signum, "code": e.code, "step": e.step, "path": e.path}
    return {"stopped": stopped, "losses": dict(module.losses), "global_step": trainer.global_step}


def _signal_at(signum: int, ranks: set[int], rank: int, at: int = K):
    def on_step(module, step):
        if step == at and rank in ranks:
            os.kill(os.getpid(), signum)
    return on_step


def _two_ranks(rank: int, world: int, out: Path, root: Path) -> dict:
    import lightning as L

    from lightning_perf.parallel.checkpointing.checkpoint import read_extra

    res = {}
    for kind, signum, ranks in (("zero3", signal.SIGTERM, {1}), ("zero3_async", signal.SIGUSR1, {0}),
                                ("dp2", signal.SIGINT, {0, 1})):
        L.seed_everything(0, verbose=False)
        first = _fit(kind, world, root, make_module(on_step=_signal_at(signum, ranks, rank)))
        folder = root / kind
        last = folder / "last.ckpt"
        left = {"names": sorted(p.name for p in folder.iterdir()), "last_is_link": last.is_symlink(),
                "last_step": read_extra(last)["extra"]["global_step"]}
        L.seed_everything(0, verbose=False)
        resumed = _fit(kind, world, root, make_module(), ckpt_path="last")
        res[kind] = {"signum": int(signum), "first": first, "left": left, "resumed": resumed}
    # a signal in the last step (to rank 1): the ranks agree at the end of the fit, and stop there the same way
    L.seed_everything(0, verbose=False)
    res["zero3_last"] = _fit("zero3_last", world, root, make_module(on_step=_signal_at(signal.SIGTERM, {1}, rank,
                                                                                      at=STEPS - 1)))
    res["zero3_last"]["last_step"] = read_extra(root / "zero3_last" / "last.ckpt")["extra"]["global_step"]
    return res


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preempt2")
    outcome = launch(_two_ranks, 2, root / "out", root, timeout=240)
    return {"ranks": outcome.check_ok(), "ref": reference(STEPS, GB, SAMPLES)}


def _check_exact(parts: list[dict], start: int, ref: dict) -> None:
    """The mean of the ranks' losses (each the loss of its half of the batch) is the one-process loss."""
    steps = sorted(parts[0])
    assert all(sorted(p) == steps for p in parts), [sorted(p) for p in parts]
    assert steps == list(range(start, start + len(steps))), steps
    mean = torch.tensor([[p[s] for s in steps] for p in parts]).mean(0)
    torch.testing.assert_close(mean, torch.tensor([ref["losses"][s] for s in steps]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["zero3", "zero3_async", "dp2"])
def test_signal_stops_every_rank_at_one_step_with_a_final_checkpoint(two_ranks, kind) -> None:
    got = [r[kind] for r in two_ranks["ranks"]]
    stops = [g["first"]["stopped"] for g in got]
    assert all(s is not None for s in stops), stops  # both ranks stopped, also the one no signal reached
    assert stops[0]["step"] == stops[1]["step"] >= K, stops
    assert all(s["signum"] == got[0]["signum"] and s["code"] == 128 + got[0]["signum"] for s in stops)
    step = stops[0]["step"]
    for g in got:
        assert g["left"]["last_step"] == step  # the checkpoint holds the step they stopped at
        assert not any(n.endswith((".tmp", ".old")) for n in g["left"]["names"]), g["left"]["names"]
    if kind == "zero3_async":  # a checkpoint of the step's name, final, and last pointing at it
        assert got[0]["left"]["last_is_link"]
        assert f"epoch=0-step={step}.ckpt" in got[0]["left"]["names"]
    _check_exact([g["first"]["losses"] for g in got], 0, two_ranks["ref"])  # before the stop: the reference


@pytest.mark.parametrize("kind", ["zero3", "zero3_async", "dp2"])
def test_resume_after_a_signal_continues_the_uninterrupted_losses(two_ranks, kind) -> None:
    got = [r[kind] for r in two_ranks["ranks"]]
    step = got[0]["first"]["stopped"]["step"]
    for g in got:
        assert g["resumed"]["stopped"] is None and g["resumed"]["global_step"] == STEPS
    _check_exact([g["resumed"]["losses"] for g in got], step, two_ranks["ref"])


def test_signal_in_the_last_step_stops_at_the_end_with_the_final_state(two_ranks) -> None:
    got = [r["zero3_last"] for r in two_ranks["ranks"]]
    for g in got:
        assert g["stopped"] is not None and g["stopped"]["step"] == STEPS and g["stopped"]["code"] == 143, g
        assert g["last_step"] == STEPS and sorted(g["losses"]) == list(range(STEPS))


# ---- one process ---------------------------------------------------------------------------------


def _one_device(rank: int, world: int, out: Path, root: Path, slurm: bool) -> dict:
    import lightning as L

    plugins = None
    if slurm:  # what an sbatch job step sets, and a stand-in scontrol that records its arguments
        from lightning.fabric.plugins.environments import SLURMEnvironment

        bin_dir = root / "bin"
        bin_dir.mkdir(exist_ok=True)
        scontrol = bin_dir / "scontrol"
        scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {root / 'scontrol.log'}\n")
        scontrol.chmod(0o755)
        os.environ.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NTASKS="1",
                          SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                          SLURM_NODELIST="localhost", SLURM_JOB_NAME="train")
        plugins = [SLURMEnvironment(auto_requeue=True)]
    signum = signal.SIGUSR1 if slurm else signal.SIGTERM
    L.seed_everything(0, verbose=False)
    first = _fit("one", 1, root, make_module(on_step=_signal_at(signum, {0}, rank)), strategy="auto",
                 plugins=plugins)
    names = sorted(p.name for p in root.iterdir())
    last = torch.load(root / "one" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    L.seed_everything(0, verbose=False)
    resumed = _fit("one", 1, root, make_module(), ckpt_path="last", strategy="auto")
    log = (root / "scontrol.log").read_text() if slurm else ""
    return {"first": first, "last_step": last, "resumed": resumed, "names": names, "scontrol": log}


@pytest.mark.parametrize("slurm", [False, True], ids=["sigterm", "slurm_requeue"])
def test_one_device_stops_saves_and_resumes_exactly(tmp_path, slurm) -> None:
    outcome = launch(_one_device, 1, tmp_path / "out", tmp_path, slurm, timeout=120)
    got = outcome.check_ok()[0]
    stopped, ref = got["first"]["stopped"], reference(STEPS, GB, SAMPLES)
    signum = signal.SIGUSR1 if slurm else signal.SIGTERM
    assert stopped is not None and stopped["signum"] == signum and stopped["code"] == 128 + signum
    assert stopped["step"] == K + 1 == got["last_step"]  # one process: the step the signal arrived in
    assert stopped["path"].endswith("last.ckpt")
    _check_exact([got["first"]["losses"]], 0, ref)
    assert got["resumed"]["stopped"] is None and got["resumed"]["global_step"] == STEPS
    _check_exact([got["resumed"]["losses"]], stopped["step"], ref)
    if slurm:  # Lightning's requeue ran: its own checkpoint in default_root_dir, then scontrol requeue
        assert got["scontrol"].split() == ["requeue", "4242"]
        assert "hpc_ckpt_1.ckpt" in got["names"]
