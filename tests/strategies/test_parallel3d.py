"""Parallel3DStrategy inside Lightning's Trainer on CPU processes (gloo) against one process.

Every layout trains the same tiny Llama-style GPT (GQA, untied head; a GPT-2-style tied
one for TP with learned positions) on the same global batch of 8 sequences (per-rank
batch 8 / dp), 6 steps over 2 epochs of 3 batches, and must reproduce the
single-process losses (rtol 1e-4) and final parameters. Spawning is the expensive part,
so each process group runs several ``Trainer.fit`` calls in turn (reusing the group):

- 2 ranks: tp2 (sequence- and batch-sharded residual stream), pp2 with every schedule, dp2 of
  a model without the protocol,
  forward-only validation, gradient accumulation, meta-device init, tp2 -> pp2 resume
  (both compiled per block, under TP with its hooks; with activation checkpointing per sublayer);
- 4 ranks: dp2 x tp2, pp2 x tp2 batch-sharded, pp2 x dp2 (ZeRO 0 and 2; bf16 against the fp32 losses at rtol
  2e-2), pp2 x tp2 -> dp4 resume + consolidation, fp16 skip-step agreement over pp and
  tp ranks;
- 8 ranks: pp2 x tp2 x dp2 with gradient-norm clipping, mesh coordinates, sampler ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _spawn import spawn

GLOBAL_B, T, STEPS, PER_EPOCH = 8, 16, 6, 3
VOCAB = 96


def tiny_config(kind: str = "llama"):
    from lightning_perf.models.gpt import GPTConfig

    # no biases: a k_proj bias has a zero true gradient and Adam would amplify rounding noise
    if kind == "llama_fp8":  # the llama shapes with FP8 block projections
        from dataclasses import replace

        return replace(tiny_config("llama"), fp8=True)
    if kind in ("gpt2", "gpt2_l4"):  # learned positions, LayerNorm, GELU, tied head
        return GPTConfig(name="t2", vocab_size=VOCAB, block_size=T, n_layer=4 if kind == "gpt2_l4" else 2,
                         n_head=4, n_embd=32, pad_vocab_multiple=16, bias=False)
    return GPTConfig(name="tl", vocab_size=VOCAB, block_size=T, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
                     intermediate_size=64, pad_vocab_multiple=16, norm="rmsnorm", activation="swiglu",
                     positions="rope", tie_embeddings=False, bias=False)


def make_plain_module():
    """A user's LightningModule without the 3D protocol: data parallelism / ZeRO only."""
    import lightning as L

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.GELU(),
                                           torch.nn.Linear(32, VOCAB, bias=False))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
            self.losses.append(loss.detach().item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Plain()


def make_module(kind: str = "llama", inject_inf_at: Optional[int] = None):
    if kind == "plain":
        return make_plain_module()
    from lightning_perf.models.gpt.module import GPTLightningModule

    class Recording(GPTLightningModule):
        def __init__(self) -> None:
            super().__init__(tiny_config(kind), learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float().item())
            return loss

        def on_after_backward(self) -> None:
            # an inf in the last rank's gradients only
            if inject_inf_at is not None and self.trainer.global_step == inject_inf_at \
                    and self.trainer.global_rank == self.trainer.world_size - 1:
                p = next(p for p in self.parameters() if p.grad is not None)
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = float("inf")

    return Recording()


def loader(per_rank_batch: int, reference: bool = False, shuffle: bool = True):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (PER_EPOCH * GLOBAL_B, T + 1), generator=g)
    dataset = TensorDataset(data[:, :-1], data[:, 1:])
    if not reference or not shuffle:  # the strategy injects a shuffling DistributedSampler over the dp ranks
        return DataLoader(dataset, batch_size=per_rank_batch)
    # the same permutation (seed 0 + epoch) on one replica: each batch is the union of the dp ranks'
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler)


def fit(strategy, world: int, *, dp: int = 1, steps: int = STEPS, kind: str = "llama", ckpt_path=None,
        save_to=None, plugins: Any = None, inject_inf_at: Optional[int] = None, accumulate: int = 1,
        val: bool = False, clip: Optional[float] = None, num_nodes: int = 1, datamodule: bool = False,
        val_sequences: Optional[int] = None, callbacks: Any = ()) -> dict:
    """``datamodule``: the loaders come from a data module that states ``batch_size`` and ``seq_len`` (as
    ``TokenDataModule`` does), so the strategy knows the batch shape before it splits the model.
    ``val_sequences``: validate on that many sequences in training-size batches, all of them (the last one
    shorter where they do not divide)."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    module = make_module(kind, inject_inf_at)
    trainer = L.Trainer(
        accelerator="cpu", devices=world // num_nodes, num_nodes=num_nodes, strategy=strategy,
        max_epochs=steps // PER_EPOCH,
        plugins=plugins, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=(1.0 if val_sequences else 1) if val or val_sequences else 0,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=list(callbacks),
    )
    # validation: the first global batch, forward only, unshuffled
    val_loader = loader(GLOBAL_B // dp, shuffle=False) if val else None
    if val_sequences:
        from torch.utils.data import DataLoader, Subset

        val = True
        val_loader = DataLoader(Subset(loader(1).dataset, range(val_sequences)), batch_size=GLOBAL_B // dp)
    train_loader = loader(GLOBAL_B // dp, reference=world == 1)
    if datamodule:
        trainer.fit(module, datamodule=_ShapedData(train_loader, val_loader, GLOBAL_B // dp), ckpt_path=ckpt_path)
    else:
        trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt_path)
    # this rank's parameters, whole: DTensors gathered over their (tp / dp) mesh, in the same order
    # on every rank of a pipeline stage; a pipeline rank holds only its stages' names
    final = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in module.state_dict().items()}
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    val_loss = float(trainer.callback_metrics["val/loss"]) if val else None
    # FSDP2 units over this rank's blocks (a unit's blocks share one FSDP state)
    from torch.distributed.fsdp import FSDPModule

    blocks = [m for name, m in module.named_modules() if name.count(".") == 2 and ".blocks." in f".{name}"]
    units = len({id(b._get_fsdp_state()) for b in blocks if isinstance(b, FSDPModule)})
    return {"losses": module.losses, "final": final, "precision": trainer.precision_plugin.state_dict(),
            "val": val_loss, "fsdp_units": units}


def _ShapedData(train: Any, val: Any, batch_size: int) -> Any:
    import lightning as L

    class ShapedData(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.seq_len = batch_size, T  # per data-parallel rank, as TokenDataModule's

        def train_dataloader(self) -> Any:
            return train

    data = ShapedData()
    if val is not None:
        data.val_dataloader = lambda: val  # type: ignore[method-assign]
    return data


# ---- process harness --------------------------------------------------------------------------




def S(**kwargs: Any):
    from lightning_perf.strategies.parallel3d import Parallel3DStrategy

    return Parallel3DStrategy(**kwargs)


# ---- workers: every run of one process group, in sequence ----------------------------------------

SCHEDULES_2 = [("1f1b", 1, 2), ("gpipe", 1, 4), ("interleaved_1f1b", 2, 4), ("zero_bubble", 2, 4),
               ("looped_bfs", 2, 4)]
if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12):
    SCHEDULES_2.append(("zbv_zero_bubble", 2, 4))  # V placement; its gloo path self-sends on torch 2.11


def _worker2(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    res["tp2"] = fit(S(tensor_parallel_size=2), world, val=True)
    res["tp2_gpt2"] = fit(S(tensor_parallel_size=2), world, kind="gpt2")
    # async TP asked for on CPU: synchronous TP (a warning), but the projections' biases are split
    # from their matmuls as async TP needs; the losses and parameters must not change
    res["tp2_gpt2_async"] = fit(S(tensor_parallel_size=2, async_tensor_parallel=True), world, kind="gpt2")
    res["dp2_plain"] = fit(S(zero_stage=3), world, dp=2, kind="plain")  # no protocol: FSDP2 only
    # the residual stream sharded along the batch: with learned positions (a replicated table added
    # to batch-sharded token rows), and compiled with the blocks' hooks
    res["tp2_gpt2_batch"] = fit(S(tensor_parallel_size=2, sequence_parallel="batch"), world, kind="gpt2")
    res["tp2_batch_compile"] = fit(S(tensor_parallel_size=2, sequence_parallel="batch", compile="default",
                                     compile_backend="aot_eager"), world)
    for name, spr, m in SCHEDULES_2:
        res[f"pp2_{name}"] = fit(S(pipeline_parallel_size=2, pipeline_schedule=name, stages_per_rank=spr,
                                   num_microbatches=m), world, val=name == "1f1b")
    res["pp2_accumulate2"] = fit(S(pipeline_parallel_size=2), world, accumulate=2)
    # built on meta, each stage initialised where it lives (values differ from one process by design)
    res["tp2_meta"] = fit(S(tensor_parallel_size=2, meta_init=True), world)
    # resharding: save under tp2 after one epoch, resume under pp2; both compiled (aot_eager: the
    # DTensor/AOTAutograd path without inductor's C++ build), per block with its TP hooks, per block under PP
    ckpt = out / "tp2.ckpt"
    res["tp2_compile"] = fit(S(tensor_parallel_size=2, compile="default", compile_backend="aot_eager"), world,
                             steps=PER_EPOCH, save_to=ckpt)
    res["tp2_to_pp2_compile"] = fit(S(pipeline_parallel_size=2, compile="default", compile_backend="aot_eager"),
                                    world, ckpt_path=ckpt)
    # compiled sublayers (with their TP hooks) inside checkpointed blocks
    res["tp2_compile_ac"] = fit(S(tensor_parallel_size=2, compile="default", compile_backend="aot_eager",
                                  activation_checkpointing="full"), world)
    return res


def _worker4(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    res["dp2_tp2"] = fit(S(tensor_parallel_size=2, zero_stage=3), world, dp=2)
    # fp16: an inf in one rank's gradients only (pp stage 1, tp rank 1) makes every rank skip
    from lightning_perf.plugins.precision import PerfPrecision

    res["pp2_tp2_fp16"] = fit(S(pipeline_parallel_size=2, tensor_parallel_size=2), world,
                              plugins=[PerfPrecision("16-mixed")], inject_inf_at=2)
    # bf16: FSDP2's mixed-precision policy under the pipeline (fp32 master weights)
    res["pp2_dp2_bf16"] = fit(S(pipeline_parallel_size=2, zero_stage=2), world, dp=2,
                              plugins=[PerfPrecision("bf16-mixed")])
    res["pp2_dp2_zero0"] = fit(S(pipeline_parallel_size=2, zero_stage=0), world, dp=2)
    # each microbatch (8 / 2 = 4 sequences) sharded by sequences over tp
    res["pp2_tp2_batch"] = fit(S(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel="batch"), world)
    res["pp2_dp2_zero2"] = fit(S(pipeline_parallel_size=2, zero_stage=2), world, dp=2)
    # two blocks per FSDP2 unit over dp (one unit per stage here), under TP and under PP
    res["dp2_tp2_units2"] = fit(S(tensor_parallel_size=2, zero_stage=3, fsdp_blocks_per_unit=2), world, dp=2)
    res["pp2_dp2_units2"] = fit(S(pipeline_parallel_size=2, zero_stage=2, fsdp_blocks_per_unit=2), world, dp=2)
    # FP8 linears: weights all-gathered over dp in FP8 == gathered plain and quantised after
    res["pp2_dp2_fp8"] = fit(S(pipeline_parallel_size=2, zero_stage=2), world, dp=2, kind="llama_fp8")
    res["pp2_dp2_fp8_gather"] = fit(S(pipeline_parallel_size=2, zero_stage=2, fp8_all_gather=True), world, dp=2,
                                    kind="llama_fp8")
    ckpt = out / "pp2tp2.ckpt"
    res["pp2_tp2"] = fit(S(pipeline_parallel_size=2, tensor_parallel_size=2), world, save_to=ckpt, steps=PER_EPOCH)
    res["pp2_tp2_to_dp4"] = fit(S(data_parallel_size=4), world, dp=4, ckpt_path=ckpt)
    if rank == 0:
        from lightning_perf.parallel.checkpointing.checkpoint import consolidate

        consolidate(ckpt, out / "consolidated.pt")
    return res


def _worker8(rank: int, world: int, out: Path) -> dict:
    strategy = S(pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=2)
    # gradient clipping by the global norm over all stages and shards (active: the norm is > 0.05)
    res = {"pp2_tp2_dp2": fit(strategy, world, dp=2, clip=0.05)}
    mesh = strategy.device_mesh
    res["coords"] = {name: mesh[name].get_local_rank() for name in ("pp", "dp", "cp", "tp")}
    res["sampler"] = strategy.distributed_sampler_kwargs
    return res


# ---- checks -------------------------------------------------------------------------------------


def _merged_final(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r[key]["final"])
    return merged


def _check_run(results: list[dict], key: str, ref: dict, *, first: int = 0, atol: float = 5e-5) -> None:
    losses = torch.tensor([r[key]["losses"] for r in results]).mean(0)  # mean over dp replicas
    expected = torch.tensor(ref["losses"][first:first + len(losses)])
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=0, msg=lambda m: f"{key} losses: {m}")
    final = _merged_final(results, key)
    assert set(final) == set(ref["final"]), f"{key}: parameter names differ: {set(final) ^ set(ref['final'])}"
    for name, value in ref["final"].items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=atol, msg=lambda m: f"{key} {name}: {m}")


@pytest.fixture(scope="module")
def references():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    def one(**kwargs: Any) -> dict:
        return fit(SingleDeviceStrategy(torch.device("cpu")), 1, **kwargs)

    return {"plain": one(kind="plain"), "llama": one(val=True), "gpt2": one(kind="gpt2"),
            "accumulate2": one(accumulate=2),
            "clip": one(clip=0.05)}


@pytest.mark.slow
def test_two_rank_layouts_schedules_and_resharding(references, tmp_path) -> None:
    results = spawn(_worker2, 2, tmp_path, timeout=300.0)
    ref = references["llama"]
    _check_run(results, "tp2", ref)
    _check_run(results, "tp2_gpt2", references["gpt2"])
    _check_run(results, "tp2_gpt2_async", references["gpt2"])
    _check_run(results, "dp2_plain", references["plain"])
    _check_run(results, "tp2_gpt2_batch", references["gpt2"])
    _check_run(results, "tp2_batch_compile", ref)
    for name, _, _ in SCHEDULES_2:
        _check_run(results, f"pp2_{name}", ref)
    tp2_compile = torch.tensor([r["tp2_compile"]["losses"] for r in results]).mean(0)
    torch.testing.assert_close(tp2_compile, torch.tensor(ref["losses"][:PER_EPOCH]), rtol=1e-4, atol=0)
    _check_run(results, "tp2_to_pp2_compile", ref, first=PER_EPOCH)
    _check_run(results, "tp2_compile_ac", ref)
    _check_run(results, "pp2_accumulate2", references["accumulate2"])
    meta = [r["tp2_meta"]["losses"] for r in results]
    assert meta[0] == meta[1] and all(4.0 < x < 5.5 for x in meta[0]), meta  # ~ln(96) = 4.56 at init
    for key in ("tp2", "pp2_1f1b"):  # forward-only validation, also through the pipeline schedule
        for r in results:
            assert r[key]["val"] == pytest.approx(ref["val"], rel=1e-4), (key, r[key]["val"], ref["val"])


@pytest.mark.slow
def test_four_rank_2d_layouts_and_consolidation(references, tmp_path) -> None:
    results = spawn(_worker4, 4, tmp_path, timeout=300.0)
    ref = references["llama"]
    # 4 blocks: 4 units per rank at dp2 x tp2, 2 when grouped; 2 blocks per pipeline stage: 2, then 1
    assert [r["dp2_tp2"]["fsdp_units"] for r in results] == [4] * 4
    assert [r["dp2_tp2_units2"]["fsdp_units"] for r in results] == [2] * 4
    assert [r["pp2_dp2_zero2"]["fsdp_units"] for r in results] == [2] * 4
    assert [r["pp2_dp2_units2"]["fsdp_units"] for r in results] == [1] * 4
    for key in ("dp2_tp2", "pp2_dp2_zero0", "pp2_dp2_zero2", "pp2_tp2_batch", "dp2_tp2_units2", "pp2_dp2_units2"):
        _check_run(results, key, ref)
    for r in results:  # bit for bit, and FP8 really ran (the losses differ from the bf16-free fp32 run)
        assert r["pp2_dp2_fp8_gather"]["losses"] == r["pp2_dp2_fp8"]["losses"]
        for k, v in r["pp2_dp2_fp8"]["final"].items():
            assert torch.equal(r["pp2_dp2_fp8_gather"]["final"][k], v), k
        assert r["pp2_dp2_fp8"]["losses"] != r["pp2_dp2_zero2"]["losses"]
    bf16 = torch.tensor([r["pp2_dp2_bf16"]["losses"] for r in results]).mean(0)
    torch.testing.assert_close(bf16, torch.tensor(ref["losses"]), rtol=2e-2, atol=0)
    # fp16: all four ranks skipped step 2 and halved the scale, and agree on every loss
    states = [r["pp2_tp2_fp16"]["precision"]["scaler"] for r in results]
    assert all(s == states[0] for s in states), states
    assert states[0]["skipped_steps"] == 1 and states[0]["scale"] == 2.0**15, states[0]
    fp16_losses = [r["pp2_tp2_fp16"]["losses"] for r in results]
    assert all(x == fp16_losses[0] for x in fp16_losses) and len(fp16_losses[0]) == STEPS
    torch.testing.assert_close(torch.tensor(fp16_losses[0][:2]), torch.tensor(ref["losses"][:2]), rtol=2e-2, atol=0)
    losses = torch.tensor([r["pp2_tp2"]["losses"] for r in results]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"][:PER_EPOCH]), rtol=1e-4, atol=0)
    _check_run(results, "pp2_tp2_to_dp4", ref, first=PER_EPOCH)
    # the consolidated pp2 x tp2 checkpoint loads into a plain GPT (after 3 steps)
    from lightning_perf.models.gpt import GPT

    state = torch.load(tmp_path / "consolidated.pt", weights_only=True)
    model = GPT(tiny_config())
    model.load_state_dict(state)
    ref3 = fit_reference_steps(PER_EPOCH)
    for name, value in ref3.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=5e-5)


def fit_reference_steps(steps: int) -> dict[str, torch.Tensor]:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    out = fit(SingleDeviceStrategy(torch.device("cpu")), 1, steps=steps)["final"]
    return {k[len("model."):]: v for k, v in out.items()}


@pytest.mark.slow
def test_eight_rank_pp2_tp2_dp2(references, tmp_path) -> None:
    results = spawn(_worker8, 8, tmp_path, timeout=400.0)
    assert references["clip"]["losses"][-1] != pytest.approx(references["llama"]["losses"][-1], rel=1e-3)
    _check_run(results, "pp2_tp2_dp2", references["clip"])
    from lightning_perf.parallel.layout.dims import ParallelDims

    dims = ParallelDims(tensor_parallel_size=2, pipeline_parallel_size=2, world_size=8)
    for rank, r in enumerate(results):
        assert r["coords"] == dims.coordinates(rank)
        assert r["sampler"] == {"num_replicas": 2, "rank": dims.coordinates(rank)["dp"]}
