"""A preemption whose checkpoint write fails: the rank functions shared by the CPU (gloo) and GPU tests.

Every run trains the tiny GPT of ``_harness`` under ``ZeroStrategy(stage=3)`` with saves in the
background and a ``ModelCheckpoint`` every ``EVERY`` steps (``last.ckpt`` only). ``interrupted``:
SIGTERM to rank 0 at step ``K``; from step ``K + 1`` on, ``FileSystemWriter.write_data`` (DCP's
write of the shards) fails on the ranks ``failing`` names, with the error a full GPU gave, in the
writer thread only (``where="writer"``: what a thread on the wrong device hits) or in every thread
(``"always"``: the foreground retry fails too). On a GPU the ranks also fill their card to within
``LEFT_FREE`` bytes before the signal. Each rank records what it saw and leaves with the
``Preempted`` it got, so the process's exit status is the stop's. ``after``: the uninterrupted
reference (a checkpoint of every step) and the resume of each interrupted run to the end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _harness import data, make_module

GB, SAMPLES, STEPS, K, EVERY = 4, 64, 6, 2, 3  # global batch, samples, steps, the signal's step, save interval
STOP = K + 2  # two ranks agree one step after the signal: the stop (and its checkpoint) is at this step
LEFT_FREE = 256 * 2**20  # what the GPU run leaves free on its card (bytes)
OOM = "CUDA error: out of memory"
SCENARIOS = {  # name: (failing ranks, where)
    "writer_fails_on_rank1": ({1}, "writer"),
    "writer_fails_on_both": ({0, 1}, "writer"),
    "every_write_fails_on_rank1": ({1}, "always"),
}
FULL_GPU = "full_gpu"  # the GPU run: nothing planted, the card full but LEFT_FREE
PLANTS = {**SCENARIOS, FULL_GPU: (set(), "writer")}


def _strategy(accelerator: str, timeout: float, async_checkpoint: bool):
    from lightning_perf.strategies import ZeroStrategy

    return ZeroStrategy(stage=3, timeout=timeout, async_checkpoint=async_checkpoint)


def _trainer(accelerator: str, world: int, root: Path, folder: str, *, timeout: float, async_checkpoint: bool = True,
             every: int = EVERY, keep_all: bool = False):
    import lightning as L

    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / folder, every_n_train_steps=every,
                                                      save_top_k=-1 if keep_all else 0, save_last=True)
    return L.Trainer(accelerator=accelerator, devices=world, strategy=_strategy(accelerator, timeout, async_checkpoint),
                     max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0, callbacks=[checkpoints], default_root_dir=root)


def _fail_writes(where: str) -> None:
    """DCP's shard write raises what an out-of-memory CUDA call raised, in the writer thread or everywhere."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, *args, **kwargs):
        if where == "always" or threading.current_thread() is not threading.main_thread():
            raise RuntimeError(OOM)
        return real(self, *args, **kwargs)

    FileSystemWriter.write_data = write_data


def _fill_device(keep: list) -> dict[str, int]:
    """Allocate the card's free memory but ``LEFT_FREE`` (kept alive in ``keep``); the free bytes before and after."""
    free, _ = torch.cuda.mem_get_info()
    chunk = 256 * 2**20
    while True:
        now, _ = torch.cuda.mem_get_info()
        if now - chunk < LEFT_FREE:
            break
        keep.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    rest = torch.cuda.mem_get_info()[0] - LEFT_FREE
    if rest > 2**20:
        keep.append(torch.empty(rest, dtype=torch.uint8, device="cuda"))
    return {"free_before": int(free), "free_after": int(torch.cuda.mem_get_info()[0])}


def interrupted(rank: int, world: int, out: Path, root: Path, name: str, accelerator: str, timeout: float) -> None:
    """The run a SIGTERM stops at step ``K`` while its writes fail; leaves by the stop's ``Preempted``."""
    import lightning as L

    from lightning_perf.callbacks import Preempted

    failing, where = PLANTS[name]
    seen: dict[str, Any] = {"name": name}
    filler: list = []

    def on_step(module, step):
        trainer = module.trainer
        if step == K:
            if accelerator == "gpu":
                seen["memory"] = _fill_device(filler)
            if rank == 0:
                seen["signal_time"] = time.time()
                os.kill(os.getpid(), signal.SIGTERM)
        if step == K + 1:
            trainer.strategy.wait_for_checkpoint()  # step 3's save is final before the writes start failing
            seen["before_stop"] = trainer.strategy.wait_for_checkpoint()
            if rank in failing:
                _fail_writes(where)

    L.seed_everything(0, verbose=False)
    module = make_module(on_step=on_step)
    trainer = _trainer(accelerator, world, root, name, timeout=timeout)
    try:
        trainer.fit(module, data(GB, world, SAMPLES))
        seen["stopped"] = None
    except Preempted as e:
        seen["stopped"] = {"signum": e.signum, "code": e.code, "step": e.step, "path": e.path, "error": e.error,
                           "time": time.time()}
        torch.save(seen, out / f"rank{rank}.pt")
        raise
    torch.save(seen, out / f"rank{rank}.pt")


def after(rank: int, world: int, out: Path, root: Path, accelerator: str, timeout: float,
          names: list[str]) -> dict:
    """The uninterrupted reference (a checkpoint of every step: ``reference/epoch=0-step=<n>.ckpt``), then each
    interrupted run of ``names`` resumed with ``ckpt_path="last"`` to the end (its ``last.ckpt`` then holds the
    final step)."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    trainer = _trainer(accelerator, world, root, "reference", timeout=timeout, async_checkpoint=False, every=1,
                       keep_all=True)
    trainer.fit(make_module(), data(GB, world, SAMPLES))
    res: dict[str, Any] = {}
    for name in names:
        L.seed_everything(0, verbose=False)
        module = make_module()
        trainer = _trainer(accelerator, world, root, name, timeout=timeout)
        trainer.fit(module, data(GB, world, SAMPLES), ckpt_path="last")
        res[name] = {"global_step": trainer.global_step, "first_step": min(module.losses)}
    return res


def read_whole(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def assert_same_state(got: Path, want: Path) -> None:
    """Parameters and optimizer state (AdamW's step, exp_avg, exp_avg_sq) of two checkpoints, and their step."""
    from lightning_perf.parallel.checkpointing.checkpoint import read_extra, verify_files

    a, b = read_whole(got), read_whole(want)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert any(k.startswith("optim.") for k in a) and any(k.startswith("model.") for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{got.name} {k}: {m}")
    blob = read_extra(got)
    verify_files(got, blob["files"])  # complete: every file has the size and CRC-32 it was saved with
    assert blob["extra"]["global_step"] == read_extra(want)["extra"]["global_step"]
