"""Shared pieces of the reliability tests: rank processes that may die, a tiny GPT, token data.

``launch`` starts one process per rank (forked from the warm interpreter of ``tests/_warm.py``)
and never fails the test by itself: it returns each rank's exit code, result (``rank{r}.pt``)
or traceback (``rank{r}.err``) and when the error was written, so a test can assert how a rank
failed and how fast.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp
from _spawn import enter_rank, free_port
from _warm import context, stop

T = 32  # sequence length = block_size of the tiny GPT
VOCAB = 128


def tiny_config():
    from lightning_perf.models.gpt import GPTConfig

    # bias-free: a k_proj bias has a zero true gradient and Adam amplifies its rounding noise
    return GPTConfig.from_name("tiny", n_layer=2, n_embd=64, n_head=2, block_size=T, vocab_size=VOCAB,
                               pad_vocab_multiple=16, bias=False, tie_embeddings=False)


def make_module(**hooks: Any):
    """A GPTLightningModule that records (global_step, loss) and a fingerprint of each batch.

    ``hooks``: ``on_step(module, global_step)`` called at every training batch start (fault injection),
    ``nan_at`` (global steps whose loss is NaN), ``skip_batches`` (batch indices that return ``None``:
    Lightning then takes no optimizer step, the reference of a skipped step).
    """
    from lightning_perf.models.gpt.module import GPTLightningModule

    on_step: Optional[Callable[[Any, int], Any]] = hooks.get("on_step")
    nan_at: set[int] = set(hooks.get("nan_at", ()))  # global steps whose loss becomes NaN
    skip_batches: set[int] = set(hooks.get("skip_batches", ()))  # batches that take no step (None)

    class Recording(GPTLightningModule):
        def __init__(self) -> None:
            # constant LR: the second half of a run equals a resumed run
            super().__init__(tiny_config(), learning_rate=3e-3, warmup_steps=0, min_lr_ratio=1.0)
            self.losses: dict[int, float] = {}
            self.samples: list[tuple[int, list[int]]] = []

        def on_train_batch_start(self, batch, batch_idx):
            if on_step is not None:
                return on_step(self, self.trainer.global_step)
            return None

        def training_step(self, batch, batch_idx):
            x, _ = batch
            # the synthetic windows are random: the first 4 tokens identify a sample
            ids = (x[:, :4].long() * torch.tensor([1, VOCAB, VOCAB**2, VOCAB**3], device=x.device)).sum(1)
            self.samples.append((self.trainer.global_step, ids.tolist()))
            if batch_idx in skip_batches:
                return None
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_step in nan_at:
                loss = loss * float("nan")
            self.losses[self.trainer.global_step] = loss.detach().float().item()
            return loss

    return Recording()


def data(global_batch: int, dp: int, samples: int):
    from lightning_perf.data import TokenDataModule

    return TokenDataModule(source="synthetic", vocab_size=VOCAB, seq_len=T, batch_size=global_batch // dp, seed=3,
                           synthetic_train_samples=samples, synthetic_val_samples=global_batch)


def trainer(strategy: Any, world: int, *, steps: int, ckpt_dir: Optional[Path] = None, every: int = 2,
            callbacks: Optional[list] = None, **kwargs: Any):
    import lightning as L

    cbs = list(callbacks or [])
    if ckpt_dir is not None:
        cbs.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=0, save_last=True,
                                                       every_n_train_steps=every))
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=cbs,
                     **kwargs)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ---- processes --------------------------------------------------------------------------------


def _entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, args: tuple, env: dict) -> None:
    enter_rank(rank, world, port, out_dir, env)
    out = Path(out_dir)
    try:
        result = fn(rank, world, out, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except SystemExit:  # a requested stop (PreemptionCheckpoint's Preempted): the process ends with its code
        raise
    except BaseException as e:
        (out / f"rank{rank}.err").write_text(f"{time.time()}\n{type(e).__name__}\n{traceback.format_exc()}")
        raise SystemExit(1)


@dataclass
class Outcome:
    exitcodes: list[Optional[int]]
    results: list[Optional[Any]]
    errors: list[Optional[str]]  # "<ExceptionType>\n<traceback>"
    error_times: list[Optional[float]]
    ended: list[float] = field(default_factory=list)  # wall time each process was seen finished

    def check_ok(self) -> list[Any]:
        assert all(c == 0 for c in self.exitcodes), (self.exitcodes, self.errors)
        return self.results


def launch(fn: Callable, world: int, out_dir: Path, *args: Any, timeout: float = 120.0) -> Outcome:
    """Run ``fn(rank, world, out_dir, *args)`` on ``world`` spawned gloo-ready processes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # a fork server that imported torch and Lightning once forks every rank of every launch:
    # no per-process import (most of a spawned rank's start-up), and no fork of a process
    # whose OpenMP pool already ran (the test process trains too)
    ctx = context() or mp.get_context("spawn")
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, fn, world, port, str(out_dir), args, env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    ended: list[float] = [0.0] * world
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if not p.is_alive() and not ended[r]:
                ended[r] = time.time()
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    stop([procs[r].pid for r in hung])  # a hang: stacks into the rank's log; the test fails on the exit code
    for r, p in enumerate(procs):
        p.join()
        if not ended[r] and r not in hung:
            ended[r] = time.time()
    results, errors, times = [], [], []
    for r in range(world):
        res = out_dir / f"rank{r}.pt"
        err = out_dir / f"rank{r}.err"
        results.append(torch.load(res, weights_only=False) if res.exists() else None)
        if err.exists():
            when, _, rest = err.read_text().partition("\n")
            errors.append(rest)
            times.append(float(when))
        elif r in hung:
            log = (out_dir / f"rank{r}.log").read_text(errors="replace")
            errors.append(f"Hang\nno result in {timeout}s; the end of its log:\n{log[-6000:]}")
            times.append(None)
        else:
            errors.append(None)
            times.append(None)
    return Outcome([p.exitcode for p in procs], results, errors, times, ended)


def reference(steps: int, global_batch: int, samples: int) -> dict:
    """One process, Lightning's default strategy, the global batch: losses and sample ids per step."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    module = make_module()
    trainer(None or "auto", 1, steps=steps).fit(module, data(global_batch, 1, samples))
    return {"losses": module.losses, "samples": module.samples}
