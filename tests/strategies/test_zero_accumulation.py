"""ZeroStrategy's gradient accumulation modes on 2 CPU processes (gloo) against one process.

With ``accumulate_grad_batches=4``, each optimizer step of the 2-rank run trains on 8 micro-batches
(4 per rank) whose union is the one batch the single process steps on: losses and parameters after 3
steps agree to fp32 summation order, at stages 1-3 in every mode. The collectives of every micro-batch
are counted (FSDP2's all-gathers and reduce-scatters through ``torch.distributed``, DDP's bucket
all-reduces through a counting communication hook), so each mode is held to its schedule, not only to
its numbers. One 2-process group runs every fit in sequence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _spawn import spawn

B, T, VOCAB, N_LAYER = 2, 16, 100, 2  # micro-batch per rank, sequence, vocabulary, blocks
WORLD, ACC, STEPS = 2, 4, 3  # ranks, micro-batches per optimizer step, optimizer steps
GLOBAL = WORLD * ACC * B  # rows per optimizer step
MODES = ("reduce_each", "reduce_once", "gather_once")
UNITS = N_LAYER + 1  # one FSDP2 unit per block, and the root


def tiny_config(**overrides: Any):
    from lightning_perf.models.gpt import GPTConfig

    # no biases: a k_proj bias has a zero true gradient and Adam would amplify rounding noise
    return GPTConfig(**{"name": "t", "vocab_size": VOCAB, "block_size": T, "n_layer": N_LAYER, "n_head": 2,
                        "n_embd": 32, "pad_vocab_multiple": 16, "bias": False, **overrides})


def make_module(fp8: bool = False):
    from lightning_perf.models.gpt.module import GPTLightningModule

    config = tiny_config(fp8=True, n_embd=48) if fp8 else tiny_config()

    class Recording(GPTLightningModule):
        def __init__(self) -> None:
            super().__init__(config, learning_rate=1e-3, warmup_steps=0, min_lr_ratio=1.0)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float().item())
            return loss

    return Recording()


def loader(world: int, rank: int, batch: int):
    """Rank r's micro-batch i holds rows (i * B + j) * world + r: the 8 micro-batches of step k are rows
    k * GLOBAL ... (k + 1) * GLOBAL - 1, the single process's batch k. Resumable, so a resumed fit
    reads on where the saved one stopped."""
    from torch.utils.data import TensorDataset

    from lightning_perf.data.loader import ResumableDataLoader, ResumableSampler

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (STEPS * GLOBAL, T + 1), generator=g)
    ds = TensorDataset(data[:, :-1], data[:, 1:])
    sampler = ResumableSampler(len(ds), num_replicas=world, rank=rank, shuffle=False)
    return ResumableDataLoader(ds, batch_size=batch, sampler=sampler)


class Counter:
    """Counts FSDP2's all-gathers and reduce-scatters at ``torch.distributed``'s functions (each name torch
    may call them by: ``all_gather_single`` on torch 2.13, ``all_gather_into_tensor`` before; one call
    counted once even where one name forwards to another)."""

    NAMES = {"all_gather": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")}

    def __init__(self) -> None:
        import torch.distributed as dist

        self.counts = {"all_gather": 0, "reduce_scatter": 0, "ddp_all_reduce": 0}
        self._depth = 0
        for kind, names in self.NAMES.items():
            for name in names:
                if hasattr(dist, name):
                    setattr(dist, name, self._wrap(kind, getattr(dist, name)))

    def _wrap(self, kind: str, fn):
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.counts[kind] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def ddp_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.counts["ddp_all_reduce"] += 1
        return default_hooks.allreduce_hook(state, bucket)


def per_micro_batch(counter: Counter, *, mid_save: Optional[Path] = None):
    """A callback: the collectives of each micro-batch; with ``mid_save``, a checkpoint saved after the
    second micro-batch of the second step (parameters held gathered under gather_once) and the
    parameters after the first step (which it must hold)."""
    import lightning as L
    import torch.nn as nn

    class PerMicroBatch(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, int]] = []
            self.units = 0
            self.after_step1: Optional[dict[str, torch.Tensor]] = None

        def on_train_start(self, trainer, pl_module):
            from torch.distributed.fsdp import FSDPModule

            self.units = sum(isinstance(m, FSDPModule) for m in pl_module.modules())
            if isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel):
                trainer.strategy.model.register_comm_hook(None, counter.ddp_hook)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if mid_save is not None and batch_idx == ACC:  # between steps: parameters sharded, as saved below
                from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict

                self.after_step1 = full_model_state_dict(pl_module)
            self._start = dict(counter.counts)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows.append({k: v - self._start[k] for k, v in counter.counts.items()})
            if mid_save is not None and batch_idx == ACC + 1:
                trainer.save_checkpoint(mid_save)

    return PerMicroBatch()


def fit(strategy: Any, world: int, *, steps: int = STEPS, accumulate: int = ACC, counter: Optional[Counter] = None,
        mid_save: Optional[Path] = None, save_to: Optional[Path] = None, ckpt_path: Optional[Path] = None,
        fp8: bool = False) -> dict:
    import lightning as L

    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict

    L.seed_everything(0, verbose=False)
    module = make_module(fp8)
    callbacks = []
    probe = per_micro_batch(counter, mid_save=mid_save) if counter is not None else None
    if probe is not None:
        callbacks.append(probe)
    if save_to is not None:  # by ModelCheckpoint, after the step's last micro-batch
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=save_to.parent, filename=save_to.stem,
                                                              save_top_k=1, every_n_train_steps=steps))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=save_to is not None,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks)
    rank = int(os.environ["LOCAL_RANK"]) if world > 1 else 0
    trainer.fit(module, loader(world, rank, B if world > 1 else GLOBAL),
                ckpt_path=str(ckpt_path) if ckpt_path else None)
    out = {"losses": module.losses, "final": full_model_state_dict(module)}
    if probe is not None:
        out.update(rows=probe.rows, units=probe.units, after_step1=probe.after_step1)
    if hasattr(trainer.strategy, "accumulation_mode"):
        out["mode"] = trainer.strategy.accumulation_mode
    return out


def _worker(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.parallel.checkpointing.checkpoint import consolidated_state_dict
    from lightning_perf.strategies import ZeroStrategy

    counter = Counter()
    res: dict[str, Any] = {}
    for stage in (1, 2, 3):
        for mode in (*MODES, "auto"):
            if mode == "auto" and stage != 3:
                continue
            res[f"{stage}/{mode}"] = fit(ZeroStrategy(stage=stage, accumulation=mode), world, counter=counter)
    # FP8 linears whose weights are all-gathered in FP8 (scales refreshed after each optimizer step), held
    # gathered across the micro-batches, against the plain gather of the same model on every micro-batch
    res["fp8/plain"] = fit(ZeroStrategy(stage=3, accumulation="reduce_once"), world, counter=counter, fp8=True)
    res["fp8/gather_once"] = fit(ZeroStrategy(stage=3, accumulation="gather_once", fp8_all_gather=True), world,
                                 counter=counter, fp8=True)
    # a checkpoint saved between micro-batches under gather_once: the parameters of the last step, and
    # training goes on as if it had not been saved (the accumulated gradients stay)
    mid = out / "mid.ckpt"
    res["mid_save"] = fit(ZeroStrategy(stage=3, accumulation="gather_once"), world, counter=counter, mid_save=mid)
    if rank == 0:
        res["mid_saved"] = consolidated_state_dict(mid, prefix="")
    # saved by ModelCheckpoint after step 2, resumed to step 3
    saved = out / "step2.ckpt"
    fit(ZeroStrategy(stage=3, accumulation="gather_once"), world, steps=2, save_to=saved)
    res["resumed"] = fit(ZeroStrategy(stage=3, accumulation="gather_once"), world, ckpt_path=saved)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(_worker, WORLD, tmp_path_factory.mktemp("zero_accumulation"), timeout=420)


@pytest.fixture(scope="module")
def reference():
    """One process stepping on the whole global batch, no accumulation."""
    return fit("auto", 1, accumulate=1)


def _close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def _step_losses(runs: list[dict], key: str) -> torch.Tensor:
    """The mean loss of each optimizer step over both ranks' micro-batches (equal sizes: the global batch's)."""
    losses = torch.tensor([r[key]["losses"] for r in runs])  # (ranks, steps * ACC)
    return losses.view(len(runs), -1, ACC).mean(dim=(0, 2))


def _column(rows: list[dict], kind: str) -> list[int]:
    return [row[kind] for row in rows]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_one_process(runs, reference, stage, mode) -> None:
    key = f"{stage}/{mode}"
    torch.testing.assert_close(_step_losses(runs, key), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    for r in runs:
        _close(r[key]["final"], reference["final"])
    assert runs[0][key]["mode"] == ("reduce_once" if (stage, mode) == (1, "gather_once") else mode)


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp_collectives_per_micro_batch(runs, stage) -> None:
    # forward gathers every unit; at stage 3 backward gathers again the units resharded after forward
    # (every block but the last: the last block and the root keep theirs for backward)
    per_pass = UNITS + (N_LAYER - 1 if stage == 3 else 0)
    once = [0] * (ACC - 1) + [UNITS]  # reduce-scattered at the last micro-batch only
    expected = {
        "reduce_each": ([per_pass] * ACC, [UNITS] * ACC),
        "reduce_once": ([per_pass] * ACC, once),
        "gather_once": ([UNITS] + [0] * (ACC - 1), once),  # one all-gather per unit and step, in its first forward
    }
    for mode, (gathers, scatters) in expected.items():
        for r in runs:
            rows = r[f"{stage}/{mode}"]["rows"]
            assert r[f"{stage}/{mode}"]["units"] == UNITS
            assert len(rows) == STEPS * ACC
            assert _column(rows, "all_gather") == gathers * STEPS, (mode, rows)
            assert _column(rows, "reduce_scatter") == scatters * STEPS, (mode, rows)


def test_ddp_all_reduces_per_micro_batch(runs) -> None:
    for r in runs:
        each = _column(r["1/reduce_each"]["rows"], "ddp_all_reduce")
        buckets = each[0]
        assert buckets >= 1 and each == [buckets] * (STEPS * ACC)
        for mode in ("reduce_once", "gather_once"):
            assert _column(r[f"1/{mode}"]["rows"], "ddp_all_reduce") == ([0] * (ACC - 1) + [buckets]) * STEPS
        for mode in MODES:  # DDP's all-reduce never goes through the FSDP2 collectives
            assert set(_column(r[f"1/{mode}"]["rows"], "reduce_scatter")) == {0}


def test_auto_without_a_memory_verdict_is_reduce_once(runs) -> None:
    for r in runs:
        assert r["3/auto"]["mode"] == "reduce_once"
        assert r["3/auto"]["rows"] == r["3/reduce_once"]["rows"]


def test_fp8_all_gather_once_equals_the_plain_gather(runs) -> None:
    for r in runs:
        plain, gathered = r["fp8/plain"], r["fp8/gather_once"]
        assert gathered["losses"] == plain["losses"]
        _close(gathered["final"], plain["final"], rtol=0, atol=0)
        assert _column(gathered["rows"], "all_gather") == ([UNITS] + [0] * (ACC - 1)) * STEPS
        assert _column(plain["rows"], "all_gather") == [UNITS + N_LAYER - 1] * (STEPS * ACC)


def test_checkpoint_between_micro_batches_under_gather_once(runs) -> None:
    rows = runs[0]["mid_save"]["rows"]
    # the save reshards the parameters held gathered: the next micro-batch gathers them once more
    assert _column(rows, "all_gather")[ACC:2 * ACC] == [UNITS, 0, UNITS, 0]
    assert _column(rows, "reduce_scatter") == ([0] * (ACC - 1) + [UNITS]) * STEPS
    _close(runs[0]["mid_saved"], runs[0]["mid_save"]["after_step1"], rtol=0, atol=0)
    for r in runs:  # the accumulated gradients survived the save: the same training as without it
        _close(r["mid_save"]["final"], r["3/gather_once"]["final"], rtol=0, atol=0)
        assert r["mid_save"]["losses"] == r["3/gather_once"]["losses"]


def test_resume_after_a_step_under_gather_once(runs, reference) -> None:
    torch.testing.assert_close(_step_losses(runs, "resumed"), torch.tensor(reference["losses"][2:]),
                               rtol=1e-5, atol=1e-6)
    for r in runs:
        _close(r["resumed"]["final"], reference["final"])
