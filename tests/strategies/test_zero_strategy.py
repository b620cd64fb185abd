"""ZeroStrategy inside Lightning's Trainer on CPU processes (gloo) against one process.

Spawning is the expensive part, so one 2-process group runs every 2-rank check in
sequence (each ``Trainer.fit`` reuses the process group) and one 4-process group saves
the checkpoint that the 2-process group resumes at a different world size. The
single-process references run in the test process with Lightning's default strategy.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _spawn import spawn

B, T, STEPS = 2, 16, 10  # per-rank batch, sequence, steps per epoch (of 2 ranks)
WORLD_REF = 2  # the reference process sees the global batch of 2 ranks
VOCAB = 100


def tiny_config():
    from lightning_perf.models.gpt import GPTConfig

    # no biases: a k_proj bias has a zero true gradient and Adam would amplify rounding noise
    return GPTConfig(name="t", vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32,
                     pad_vocab_multiple=16, bias=False)


def make_module(**kwargs: Any):
    import lightning as L  # noqa: F401

    from lightning_perf.models.gpt.module import GPTLightningModule

    class Recording(GPTLightningModule):
        def __init__(self, inject_inf_at: Optional[int] = None, **kw: Any) -> None:
            # constant LR: a 10-step leg is the first half of a 20-step run
            super().__init__(tiny_config(), learning_rate=1e-3, warmup_steps=0, min_lr_ratio=1.0, **kw)
            self.inject_inf_at = inject_inf_at
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float().item())
            return loss

        def on_after_backward(self) -> None:
            # an inf in rank 1's gradient shard only (reduction already happened)
            if self.inject_inf_at is not None and self.trainer.global_step == self.inject_inf_at \
                    and self.trainer.global_rank == 1:
                p = next(p for p in self.parameters() if p.grad is not None)
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = float("inf")

    return Recording(**kwargs)


def make_generic(**kwargs: Any):
    """A LightningModule around a non-GPT network shaped like a Hugging Face decoder
    (``net.model.layers`` is a ``ModuleList``), built in ``__init__`` rather than ``configure_model``."""
    import lightning as L
    import torch.nn as nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32)
            self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 32)
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(Layer() for _ in range(3))
            self.head = nn.Linear(32, VOCAB, bias=False)

        def forward(self, idx):
            x = self.embed(idx)
            for layer in self.model.layers:
                x = layer(x)
            return self.head(x)

    class Generic(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
            self.losses.append(loss.detach().item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Generic(**kwargs)


def make_generic_sgd():
    module = make_generic()
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.1)
    return module


def loader(world: int, epochs_of: int = STEPS, *, rank: Optional[int] = None, batch: int = B):
    """Rank r, step k sees rows k*world*B + r + world*j: one step's union is one reference batch.

    The project's resumable loader, so a resumed run sees the batches an uninterrupted one would.
    """
    from torch.utils.data import TensorDataset

    from lightning_perf.data.loader import ResumableDataLoader, ResumableSampler

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (epochs_of * WORLD_REF * B, T + 1), generator=g)
    ds = TensorDataset(data[:, :-1], data[:, 1:])
    rank = int(os.environ["LOCAL_RANK"]) if rank is None else rank
    sampler = ResumableSampler(len(ds), num_replicas=world, rank=rank, shuffle=False)
    return ResumableDataLoader(ds, batch_size=batch, sampler=sampler)


class Probe:
    """Per-rank element counts: parameters at rest, gradients before the step, optimizer state."""

    @staticmethod
    def make():
        import lightning as L

        from lightning_perf.parallel.sharding.ddp import local_optimizer

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        class _Probe(L.Callback):
            def __init__(self) -> None:
                self.stats: dict[str, int] = {}

            def on_train_start(self, trainer, pl_module):
                from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict

                self.init = {k: v.clone() for k, v in full_model_state_dict(pl_module).items()}

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == 1:
                    self.stats["params"] = sum(local(p).numel() for p in pl_module.parameters())

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                self.stats["grads"] = sum(local(p.grad).numel() for p in pl_module.parameters() if p.grad is not None)

            def on_train_end(self, trainer, pl_module):
                opt = local_optimizer(trainer.optimizers[0])
                self.stats["optim"] = sum(local(t).numel() for s in opt.state.values() for t in s.values()
                                          if torch.is_tensor(t) and t.dim() > 0)

        return _Probe()


def fit(strategy, world: int, *, steps: int = STEPS, accumulate: int = 1, ckpt_path=None, save_to=None,
        plugins=None, module_kwargs=None, epochs_of: int = STEPS, factory=None, precision="32-true", clip=None):
    import lightning as L

    L.seed_everything(0, verbose=False)
    module = (factory or make_module)(**(module_kwargs or {}))
    probe = Probe.make()
    callbacks = [probe]
    if save_to is not None:  # mid-epoch, by ModelCheckpoint: the loader position is saved too
        save_to = Path(save_to)
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=save_to.parent, filename=save_to.stem,
                                                              save_top_k=1, every_n_train_steps=steps))
    trainer = L.Trainer(
        accelerator="cpu", devices=world if world > 1 else 1, strategy=strategy, max_steps=steps,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=save_to is not None,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks,
        plugins=plugins, use_distributed_sampler=False, precision=None if plugins else precision,
        gradient_clip_val=clip,
    )
    # the reference sees the global batch of WORLD_REF ranks per step
    data = loader(world, epochs_of) if world > 1 else loader_ref(epochs_of)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict

    final = full_model_state_dict(module)
    return {"losses": module.losses, "final": final, "stats": probe.stats, "init": probe.init,
            "precision": trainer.precision_plugin.state_dict()}


def loader_ref(epochs_of: int = STEPS):
    return loader(1, epochs_of, rank=0, batch=B * WORLD_REF)


# ---- process harness --------------------------------------------------------------------------




# ---- workers ------------------------------------------------------------------------------------


def _worker4(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.strategies import ZeroStrategy

    # 4 ranks, global batch 4*B, saved after one 10-step epoch; the 2-rank group resumes it
    r = fit(ZeroStrategy(stage=3), world, save_to=str(out / "ckpt4.ckpt"), epochs_of=2 * STEPS)
    return {"losses": r["losses"], "final": r["final"]}


def _without_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU backend compiles its shared-memory allreduce (a C++ extension, most of a minute
    on a fresh machine) when it starts; only its inference allreduce uses it, never ZeRO training,
    which reduces through the gloo group either way."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _worker2(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.plugins import PerfPrecision
    from lightning_perf.strategies import ZeroStrategy, register_strategies

    register_strategies()

    res: dict[str, Any] = {}
    for stage in (1, 2, 3):
        res[f"native{stage}"] = fit(ZeroStrategy(stage=stage), world)
        res[f"native{stage}_acc"] = fit(ZeroStrategy(stage=stage), world, accumulate=2, steps=STEPS // 2)
    # Trainer(precision=...) becomes PerfPrecision: bf16 FSDP2 policy / bf16 weights
    res["bf16_mixed"] = fit(ZeroStrategy(stage=3), world, precision="bf16-mixed")
    res["bf16_true"] = fit(ZeroStrategy(stage=2), world, precision="bf16-true")
    # composes with activation checkpointing; any LightningModule (a Hugging Face-shaped network)
    res["native3_ac"] = fit(ZeroStrategy(stage=3), world, module_kwargs={"activation_checkpointing": "full"})
    res["generic3"] = fit(ZeroStrategy(stage=3), world, factory=make_generic)
    res["native3_clip"] = fit(ZeroStrategy(stage=3), world, clip=0.05)  # norm over all shards
    # with the fused AdamW the clip rides on the fused step: the norm over all shards, then the divisor
    from lightning_perf.plugins import precision as precision_mod

    folds: list[bool] = []
    real_fold = precision_mod.fold_clip_into_fused_step
    precision_mod.fold_clip_into_fused_step = lambda opt, max_norm: folds.append(real_fold(opt, max_norm)) or folds[-1]
    try:
        res["native3_clip_fused"] = fit(ZeroStrategy(stage=3), world, clip=0.05, module_kwargs={"fused_adam": True})
    finally:
        precision_mod.fold_clip_into_fused_step = real_fold
    res["native3_clip_fused"]["folded"] = sum(folds)
    # checkpoint at 10, resume to 20 (stage 3 and stage 1)
    for stage in (1, 3):
        fit(ZeroStrategy(stage=stage), world, save_to=str(out / f"ckpt{stage}.ckpt"), epochs_of=2 * STEPS)
        res[f"resume{stage}"] = fit(ZeroStrategy(stage=stage), world, steps=2 * STEPS,
                                    ckpt_path=str(out / f"ckpt{stage}.ckpt"), epochs_of=2 * STEPS)
    # a checkpoint written by 4 ranks resumes on 2 (parameters and optimizer state resharded)
    res["from4"] = fit(ZeroStrategy(stage=3), world, steps=2 * STEPS, ckpt_path=str(out / "ckpt4.ckpt"),
                       epochs_of=2 * STEPS)
    # DeepSpeed backend (CPU accelerator over gloo): stages 1-3, accumulation, offload, resume
    if importlib.util.find_spec("deepspeed") is not None:
        _without_shared_memory_allreduce()
        for stage in (1, 2, 3):
            res[f"ds{stage}"] = fit(ZeroStrategy(stage=stage, backend="deepspeed"), world)
        res["ds2_acc"] = fit(ZeroStrategy(stage=2, backend="deepspeed"), world, accumulate=2, steps=STEPS // 2)
        res["ds3_offload"] = fit(ZeroStrategy(stage=3, backend="deepspeed", offload_optimizer=True,
                                              offload_params=True), world)
        res["ds2_sgd"] = fit(ZeroStrategy(stage=2, backend="deepspeed"), world, factory=make_generic_sgd)
        res["ds3_sgd"] = fit(ZeroStrategy(stage=3, backend="deepspeed"), world, factory=make_generic_sgd)
        fit(ZeroStrategy(stage=2, backend="deepspeed"), world, save_to=str(out / "ckpt_ds.ckpt"), epochs_of=2 * STEPS)
        res["ds_resume"] = fit(ZeroStrategy(stage=2, backend="deepspeed"), world, steps=2 * STEPS,
                               ckpt_path=str(out / "ckpt_ds.ckpt"), epochs_of=2 * STEPS)
    # fp16: an inf on rank 1 only at step 3 -> both ranks skip it and halve the scale
    res["fp16"] = fit(ZeroStrategy(stage=2), world, plugins=[PerfPrecision("16-mixed", init_scale=1024.0)],
                      module_kwargs={"inject_inf_at": 3})
    # PowerSGD / fp16 compression train (approximate: loss only has to decrease)
    res["powersgd"] = fit(ZeroStrategy(stage=1, gradient_compression="powersgd", powersgd_rank=2), world)
    res["fp16hook"] = fit(ZeroStrategy(stage=1, gradient_compression="fp16"), world)
    res["fp16_scaler"] = res["fp16"]["precision"]
    # FP8 linears, weights all-gathered in FP8 (scales precomputed after each optimizer step) vs the
    # bf16-style gather of the same FP8 model: equal bit for bit, through a checkpoint too
    fp8 = {"config_overrides": {"fp8": True, "n_embd": 48}}
    res["fp8_3"] = fit(ZeroStrategy(stage=3), world, steps=2 * STEPS, epochs_of=2 * STEPS, module_kwargs=fp8)
    res["fp8_3_gather"] = fit(ZeroStrategy(stage=3, fp8_all_gather=True), world, module_kwargs=fp8,
                              save_to=str(out / "ckpt_fp8.ckpt"), epochs_of=2 * STEPS)
    res["fp8_3_gather_resume"] = fit(ZeroStrategy(stage=3, fp8_all_gather=True), world, steps=2 * STEPS,
                                     ckpt_path=str(out / "ckpt_fp8.ckpt"), epochs_of=2 * STEPS, module_kwargs=fp8)
    return res


_REFERENCES: dict[tuple, dict] = {}


def _reference(steps: int = STEPS, accumulate: int = 1, epochs_of: int = STEPS, **kwargs: Any) -> dict:
    """The single-process run (Lightning's default strategy), computed once per configuration."""
    key = (steps, accumulate, epochs_of, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = fit("auto", 1, steps=steps, accumulate=accumulate, epochs_of=epochs_of, **kwargs)
    return _REFERENCES[key]


def _close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def _rank_mean(results: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([r[key]["losses"] for r in results]).mean(0)


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    return out, spawn(_worker4, 4, out / "w4")


@pytest.fixture(scope="module")
def runs(runs4):
    out, _ = runs4
    (out / "w4" / "ckpt4.ckpt").rename(out / "ckpt4.ckpt")
    return spawn(_worker2, 2, out)


def test_stages_match_one_process(runs) -> None:
    ref = _reference()
    ref_acc = _reference(steps=STEPS // 2, accumulate=2)
    n = sum(v.numel() for v in ref["final"].values())
    for stage in (1, 2, 3):
        for r in runs:  # rank 0 built the model as one process would and sent every rank its shards
            _close(r[f"native{stage}"]["init"], ref["init"], rtol=0, atol=0)
        torch.testing.assert_close(_rank_mean(runs, f"native{stage}"), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-6)
        _close(runs[0][f"native{stage}"]["final"], ref["final"])
        _close(runs[1][f"native{stage}"]["final"], ref["final"])
        torch.testing.assert_close(_rank_mean(runs, f"native{stage}_acc"), torch.tensor(ref_acc["losses"]),
                                   rtol=1e-5, atol=1e-6)
        _close(runs[0][f"native{stage}_acc"]["final"], ref_acc["final"])
        for r in runs:
            stats = r[f"native{stage}"]["stats"]
            assert stats["optim"] <= 0.6 * 2 * n, (stage, stats, n)  # exp_avg + exp_avg_sq, ~1/2
            if stage >= 2:
                assert stats["grads"] <= n / 2 + 64, (stage, stats, n)
            if stage == 1:
                assert stats["params"] == n
            else:  # FSDP2 keeps sharded parameters between steps at stage 2 too (gathers once per step)
                assert stats["params"] <= n / 2 + 64, (stage, stats, n)


def test_precision_from_the_trainer_flag(runs) -> None:
    ref = _reference()
    for key, tol in (("bf16_mixed", 2e-2), ("bf16_true", 5e-2)):
        losses = _rank_mean(runs, key)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=tol, atol=0)
        assert runs[0][key]["precision"] == {}  # no loss scaler outside fp16
    assert runs[0]["bf16_mixed"]["final"]["model.norm.weight"].dtype == torch.float32  # fp32 master weights
    assert runs[0]["bf16_true"]["final"]["model.norm.weight"].dtype == torch.bfloat16


def test_activation_checkpointing_clipping_and_a_generic_module(runs) -> None:
    ref = _reference()
    torch.testing.assert_close(_rank_mean(runs, "native3_ac"), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    _close(runs[0]["native3_ac"]["final"], ref["final"])
    clipped = _reference(clip=0.05)
    torch.testing.assert_close(_rank_mean(runs, "native3_clip"), torch.tensor(clipped["losses"]), rtol=1e-5, atol=1e-6)
    _close(runs[0]["native3_clip"]["final"], clipped["final"])
    # the reference clips in place, then steps (Lightning's own precision plugin, one process)
    clipped_fused = _reference(clip=0.05, module_kwargs={"fused_adam": True})
    for r in runs:
        assert r["native3_clip_fused"]["folded"] == STEPS
    torch.testing.assert_close(_rank_mean(runs, "native3_clip_fused"), torch.tensor(clipped_fused["losses"]),
                               rtol=1e-5, atol=1e-6)
    _close(runs[0]["native3_clip_fused"]["final"], clipped_fused["final"])
    gen = _reference(factory=make_generic)
    torch.testing.assert_close(_rank_mean(runs, "generic3"), torch.tensor(gen["losses"]), rtol=1e-5, atol=1e-6)
    _close(runs[0]["generic3"]["final"], gen["final"])
    n = sum(v.numel() for v in gen["final"].values())
    for r in runs:  # the ModuleList layers were found and sharded
        assert r["generic3"]["stats"]["params"] <= n / 2 + 64


def test_resume_equals_uninterrupted(runs) -> None:
    ref20 = _reference(steps=2 * STEPS, epochs_of=2 * STEPS)
    for stage in (1, 3):
        torch.testing.assert_close(_rank_mean(runs, f"resume{stage}"), torch.tensor(ref20["losses"][STEPS:]),
                                   rtol=1e-5, atol=1e-6)
        _close(runs[0][f"resume{stage}"]["final"], ref20["final"])


def test_fp8_all_gather_equals_the_plain_gather(runs) -> None:
    for r in runs:
        plain, gathered, resumed = r["fp8_3"], r["fp8_3_gather"], r["fp8_3_gather_resume"]
        assert gathered["losses"] == plain["losses"][:STEPS]
        assert resumed["losses"] == plain["losses"][STEPS:]
        for k, v in plain["final"].items():
            assert torch.equal(resumed["final"][k], v), k


def test_fp16_overflow_on_one_rank_skips_everywhere(runs) -> None:
    for r in runs:
        state = r["fp16_scaler"]["scaler"]
        assert state["skipped_steps"] == 1
        assert state["scale"] == 512.0
        assert all(torch.isfinite(torch.tensor(r["fp16"]["losses"])))
    _close(runs[0]["fp16"]["final"], runs[1]["fp16"]["final"], rtol=0, atol=0)


def test_gradient_compression_trains(runs) -> None:
    for key in ("powersgd", "fp16hook"):
        losses = _rank_mean(runs, key)
        assert losses[-3:].mean() < losses[:3].mean()
        _close(runs[0][key]["final"], runs[1][key]["final"], rtol=0, atol=0)  # replicas stay equal


def test_resume_at_a_different_world_size(runs, runs4) -> None:
    _, four = runs4
    # the 2-rank run starts from the 4-rank run's final parameters, then keeps training
    _close(runs[0]["from4"]["init"], four[0]["final"], rtol=0, atol=0)
    losses = _rank_mean(runs, "from4")
    assert len(losses) == STEPS and torch.isfinite(losses).all()
    assert runs[0]["from4"]["stats"]["optim"] <= 0.6 * 2 * sum(v.numel() for v in four[0]["final"].values())


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs lightning-perf[deepspeed]")
def test_deepspeed_backend_matches_one_process(runs) -> None:
    ref = _reference()
    ref_acc = _reference(steps=STEPS // 2, accumulate=2)
    ref20 = _reference(steps=2 * STEPS, epochs_of=2 * STEPS)
    # DeepSpeed steps flattened fp32 partitions: equal to ~1e-4, not to the last bit
    for key, r in (("ds1", ref), ("ds2", ref), ("ds3", ref), ("ds3_offload", ref), ("ds2_acc", ref_acc)):
        torch.testing.assert_close(_rank_mean(runs, key), torch.tensor(r["losses"]), rtol=2e-4, atol=1e-5)
        _close(runs[0][key]["final"], r["final"], rtol=1e-2, atol=1e-3)
        _close(runs[0][key]["final"], runs[1][key]["final"], rtol=0, atol=0)
    # with plain SGD (no per-element normalisation to amplify rounding) it is exact
    sgd = _reference(factory=make_generic_sgd)
    for key in ("ds2_sgd", "ds3_sgd"):
        torch.testing.assert_close(_rank_mean(runs, key), torch.tensor(sgd["losses"]), rtol=1e-5, atol=1e-6)
        _close(runs[0][key]["final"], sgd["final"])
    n = sum(v.numel() for v in ref["final"].values())
    for key in ("ds1", "ds2", "ds3"):
        assert runs[0][key]["stats"]["optim"] <= 0.6 * 2 * n
    torch.testing.assert_close(_rank_mean(runs, "ds_resume"), torch.tensor(ref20["losses"][STEPS:]),
                               rtol=2e-4, atol=1e-5)
