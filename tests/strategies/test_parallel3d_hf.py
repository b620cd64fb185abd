"""Hugging Face weights under tensor and pipeline parallelism: ``GPTLightningModule.from_hf`` trained with
``Parallel3DStrategy`` starts from exactly the checkpoint's tensors.

Two tiny random ``transformers`` models saved to a folder: a Llama with grouped-query attention, Llama 3's
``rope_theta`` and an untied head (under tp2) and a GPT-2 with its tied head (under pp2, the first and the
last stage each holding a copy). On 2 gloo ranks, built on meta (each rank reads its own slices) and built
whole (every rank reads the folder, then shards), every rank's local shards and stage parameters must equal
the matching slices of the checkpoint, and the first losses one process's from the same folder (rtol 1e-4).
On 4 ranks, built on meta, pp2 x tp2 does the same for the tied GPT-2 and dp2 x tp2 with ZeRO-3 (FSDP2
sharding the TP shards over dp) for the Llama. The sharded checkpoints of the tp2 Llama run, of pp2 runs of
both models (the tied GPT-2, whose embedding both stages hold, and the untied Llama, whose embedding and
head sit on different stages) and of both 4-rank runs, consolidated and written with ``save_hf``, hold the
one-process run's final parameters and load in ``transformers`` with the one-process model's logits.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from _spawn import spawn
from test_parallel3d import PER_EPOCH, VOCAB, S, T, loader

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

GLOBAL_B = 8


def _save_models(folder: Path) -> None:
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=T, rope_theta=500000.0, tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(str(folder / "llama"), safe_serialization=True)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=T, vocab_size=VOCAB)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(str(folder / "gpt2"), safe_serialization=True)


class _Start:
    """Records this rank's parameters as training starts: name -> (global offset, local values, whole tensor).

    The whole tensor is gathered from the shards (a collective over the parameter's mesh), so it checks the
    shards' placement independently of the offsets the loader and this record both compute."""

    def __new__(cls):
        import lightning as L
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        class Start(L.Callback):
            def __init__(self) -> None:
                self.params: dict[str, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}

            def on_train_start(self, trainer, pl_module) -> None:
                for name, p in pl_module.named_parameters():
                    if hasattr(p, "to_local"):
                        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                        self.params[name] = (tuple(offset), p.to_local().detach().clone(),
                                             p.full_tensor().detach().clone())
                    else:
                        self.params[name] = ((0,) * p.dim(), p.detach().clone(), p.detach().clone())

        return Start()


def fit_hf(strategy, world: int, folder: Path, *, dp: int = 1, steps: int = PER_EPOCH, save_to: Any = None) -> dict:
    import lightning as L

    from lightning_perf.models.gpt.module import GPTLightningModule

    class Recording(GPTLightningModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float().item())
            return loss

    L.seed_everything(0, verbose=False)
    module = Recording.from_hf(folder, learning_rate=1e-2, warmup_steps=0, min_lr_ratio=1.0)
    module.losses = []
    start = _Start()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, callbacks=[start], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, loader(GLOBAL_B // dp, reference=world == 1))  # the same global batch for any dp
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    res = {"losses": module.losses, "start": start.params}
    if world == 1:
        res["final"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return res


def _worker2(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    for meta in (True, False):
        res[f"tp2_llama_meta{meta}"] = fit_hf(S(tensor_parallel_size=2, meta_init=meta), world, out / "llama",
                                              save_to=out / "tp2.ckpt" if meta else None)
        res[f"pp2_gpt2_meta{meta}"] = fit_hf(S(pipeline_parallel_size=2, meta_init=meta), world, out / "gpt2",
                                             save_to=out / "pp2_gpt2.ckpt" if meta else None)
    res["pp2_llama"] = fit_hf(S(pipeline_parallel_size=2, meta_init=True), world, out / "llama",
                              save_to=out / "pp2_llama.ckpt")
    return res


# 4-rank layouts, all built on meta: name -> (Parallel3DStrategy arguments, checkpoint folder, dp)
LAYOUTS4: dict[str, tuple[dict[str, Any], str, int]] = {
    "pp2_tp2_gpt2": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "gpt2", 1),
    # ZeRO-3: FSDP2 shards the TP shards over dp (rows of a column shard, rows of a row shard)
    "dp2_tp2_llama": ({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, "llama", 2),
}


def _worker4(rank: int, world: int, out: Path, layout: str) -> dict:
    kwargs, kind, dp = LAYOUTS4[layout]
    return {layout: fit_hf(S(meta_init=True, **kwargs), world, out / kind, dp=dp, save_to=out / f"{layout}.ckpt")}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> dict:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_perf.models import GPT

    folder = tmp_path_factory.mktemp("hf")
    _save_models(folder)
    runs: dict[str, Any] = {"folder": folder}
    for kind in ("llama", "gpt2"):
        runs[kind] = fit_hf(SingleDeviceStrategy(torch.device("cpu")), 1, folder / kind)
        runs[f"{kind}_hf"] = {f"model.{k}": v for k, v in GPT.from_hf(folder / kind).state_dict().items()}
    return runs


@pytest.fixture(scope="module")
def ranks2(hf_runs, tmp_path_factory) -> tuple[list[dict], Path]:
    """``_worker2`` on 2 ranks: their results and the folder holding their sharded checkpoints."""
    out = tmp_path_factory.mktemp("ranks2")
    for kind in ("llama", "gpt2"):
        (out / kind).symlink_to(hf_runs["folder"] / kind)
    return spawn(_worker2, 2, out, timeout=300.0), out


def _check_start(results: list[dict], key: str, checkpoint: dict[str, torch.Tensor], stages: list[set[str]]) -> None:
    """Every rank's starting tensors are the checkpoint's slices; rank r holds stage ``stages[r]``'s names."""
    for rank, (r, names) in enumerate(zip(results, stages)):
        start = r[key]["start"]
        assert set(start) == names, f"{key} rank {rank}: {set(start) ^ names}"
        for name, (offset, local, whole) in start.items():
            index = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
            assert torch.equal(local, checkpoint[name][index]), f"{key} rank {rank}: {name} at {offset}"
            assert torch.equal(whole, checkpoint[name]), f"{key} rank {rank}: {name} gathered"


def _check_losses(results: list[dict], key: str, ref: dict, *, dp: int = 1) -> None:
    """Each rank's losses are the one process's; with ``dp`` replicas (no pipeline: rank = dp_rank * tp +
    tp_rank) the mean of the replicas' losses, each over its part of the batch, is."""
    losses = torch.tensor([r[key]["losses"] for r in results])
    losses = losses.view(dp, -1, losses.shape[-1]).mean(0)
    for rank, rank_losses in enumerate(losses):
        torch.testing.assert_close(rank_losses, torch.tensor(ref["losses"]), rtol=1e-4,
                                   atol=0, msg=lambda m, rank=rank: f"{key} rank {rank} losses: {m}")


def _gpt2_stages(checkpoint: dict[str, torch.Tensor]) -> tuple[set[str], set[str]]:
    first = {k for k in checkpoint if k.startswith(("model.tok_emb", "model.pos_emb", "model.blocks.0."))}
    last = {k for k in checkpoint if k.startswith(("model.blocks.1.", "model.norm", "model.tok_emb"))}
    return first, last


def _check_export(ckpt: Path, kind: str, hf_runs: dict, out: Path) -> None:
    """The sharded checkpoint ``ckpt`` of a ``kind`` run, consolidated and written with ``save_hf``: its tensors
    are the one-process run's, and ``transformers`` loads it with the one-process model's logits."""
    from lightning_perf.models import GPT
    from lightning_perf.models.gpt.hf import save_hf
    from lightning_perf.parallel.checkpointing.checkpoint import consolidate

    state = torch.load(consolidate(ckpt, out / f"{ckpt.stem}.pt"), weights_only=True)
    config = GPT.from_hf(hf_runs["folder"] / kind).config
    save_hf(state, config, out / f"{ckpt.stem}-hf")
    final = {name.removeprefix("model."): value for name, value in hf_runs[kind]["final"].items()}
    assert set(state) == set(final), set(state) ^ set(final)
    for name, value in final.items():  # trained as one process would have
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=5e-5,
                                   msg=lambda m, name=name: f"{ckpt.stem} {name}: {m}")
    single = GPT(config)
    single.load_state_dict(state)
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out / f"{ckpt.stem}-hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, single.eval()(idx), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(back(idx).logits, GPT.from_hf(hf_runs["folder"] / kind).eval()(idx))


@pytest.mark.slow
def test_hf_weights_under_tp2_and_pp2(hf_runs, ranks2, tmp_path) -> None:
    results, out = ranks2
    llama, gpt2 = hf_runs["llama_hf"], hf_runs["gpt2_hf"]
    for meta in (True, False):
        # tensor parallel: both ranks hold every name, each its own rows / columns of it
        _check_start(results, f"tp2_llama_meta{meta}", llama, [set(llama)] * 2)
        _check_losses(results, f"tp2_llama_meta{meta}", hf_runs["llama"])
        # pipeline parallel: the tied embedding on both stages, equal to the checkpoint's wte
        _check_start(results, f"pp2_gpt2_meta{meta}", gpt2, list(_gpt2_stages(gpt2)))
        _check_losses(results, f"pp2_gpt2_meta{meta}", hf_runs["gpt2"])
    # the tp2 column shards of q_proj: rank 1 starts at row 32 / 2 = 16 of the checkpoint's q_proj
    q = results[1]["tp2_llama_metaTrue"]["start"]["model.blocks.0.attn.q_proj.weight"]
    assert q[0] == (16, 0) and q[1].shape == (16, 32)

    # back to Hugging Face from the sharded tp2 checkpoint: transformers gives the one-process model's logits
    _check_export(out / "tp2.ckpt", "llama", hf_runs, tmp_path)


@pytest.mark.slow
def test_hf_export_from_pp2(hf_runs, ranks2, tmp_path) -> None:
    """Back to Hugging Face from pp2 checkpoints: the tied GPT-2 (its embedding on both stages, one tensor in
    the export) and the untied Llama (embedding on the first stage, head on the last)."""
    results, out = ranks2
    llama = hf_runs["llama_hf"]
    first = {k for k in llama if k.startswith(("model.tok_emb", "model.blocks.0."))}
    _check_start(results, "pp2_llama", llama, [first, set(llama) - first])
    _check_losses(results, "pp2_llama", hf_runs["llama"])
    for kind in ("gpt2", "llama"):
        _check_export(out / f"pp2_{kind}.ckpt", kind, hf_runs, tmp_path)


def _spawn4(hf_runs: dict, out: Path, layout: str) -> list[dict]:
    kind = LAYOUTS4[layout][1]
    (out / kind).symlink_to(hf_runs["folder"] / kind)
    return spawn(partial(_worker4, layout=layout), 4, out, timeout=300.0)


@pytest.mark.slow
def test_hf_tied_gpt2_under_pp2_tp2(hf_runs, tmp_path) -> None:
    results = _spawn4(hf_runs, tmp_path, "pp2_tp2_gpt2")
    gpt2 = hf_runs["gpt2_hf"]
    first, last = _gpt2_stages(gpt2)
    _check_start(results, "pp2_tp2_gpt2", gpt2, [first, first, last, last])
    _check_losses(results, "pp2_tp2_gpt2", hf_runs["gpt2"])
    _check_export(tmp_path / "pp2_tp2_gpt2.ckpt", "gpt2", hf_runs, tmp_path)


@pytest.mark.slow
def test_hf_llama_under_dp2_tp2_zero3_meta(hf_runs, tmp_path) -> None:
    """FSDP2 over the TP shards, built on meta: each rank reads its (dp, tp) box of every tensor and trains,
    consolidated, to the one process's parameters."""
    results = _spawn4(hf_runs, tmp_path, "dp2_tp2_llama")
    llama = hf_runs["llama_hf"]
    _check_start(results, "dp2_tp2_llama", llama, [set(llama)] * 4)
    # q_proj rows: 16 per tp rank, 8 of them per dp rank (rank = dp * 2 + tp); o_proj: tp columns, dp rows
    start = [r["dp2_tp2_llama"]["start"] for r in results]
    assert [s["model.blocks.0.attn.q_proj.weight"][0] for s in start] == [(0, 0), (16, 0), (8, 0), (24, 0)]
    assert [s["model.blocks.0.attn.o_proj.weight"][0] for s in start] == [(0, 0), (0, 16), (16, 0), (16, 16)]
    _check_losses(results, "dp2_tp2_llama", hf_runs["llama"], dp=2)
    _check_export(tmp_path / "dp2_tp2_llama.ckpt", "llama", hf_runs, tmp_path)
