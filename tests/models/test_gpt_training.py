"""GPTLightningModule inside a real Trainer: the contract example, resume equality, bad input."""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_perf.data import TokenDataModule
from lightning_perf.models import GPTConfig, GPTLightningModule


class LossRecorder(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.fixture(autouse=True)
def _deterministic_mode_stays_here():
    """``Trainer(deterministic=True)`` switches torch's deterministic algorithms on for the whole process
    and sets ``CUBLAS_WORKSPACE_CONFIG``: both are put back for the tests that run after these."""
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


def _module():
    return GPTLightningModule(GPTConfig.from_name("tiny", n_layer=2, n_embd=64, n_head=2, block_size=32),
                              warmup_steps=3, learning_rate=3e-3, lr_decay_steps=20)


def _trainer(tmp_path, max_steps, callbacks):
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
        default_root_dir=tmp_path, callbacks=callbacks, gradient_clip_val=1.0,
    )


def test_contract_example_synthetic():
    model = GPTLightningModule(GPTConfig.from_name("tiny"))
    data = TokenDataModule(source="synthetic", vocab_size=model.config.vocab_size, seq_len=16, batch_size=4)
    rec = LossRecorder()
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, limit_val_batches=1, callbacks=[rec]).fit(model, data)
    assert len(rec.losses) == 3 and all(torch.isfinite(torch.tensor(rec.losses)))
    assert model.flops_per_batch == model.config.flops_per_token(16) * 4 * 16


def test_resume_mid_epoch_gives_the_same_losses(tmp_path):
    """20 steps straight == 10 steps, checkpoint, resume for 10 more (data position restored)."""
    def data():
        return TokenDataModule(source="synthetic", vocab_size=260, seq_len=32, batch_size=4,
                               synthetic_train_samples=100, synthetic_val_samples=4)

    L.seed_everything(7)
    straight = LossRecorder()
    _trainer(tmp_path / "a", 20, [straight]).fit(_module(), data())

    L.seed_everything(7)
    first = LossRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    _trainer(tmp_path / "b", 10, [first, ckpt]).fit(_module(), data())
    path = tmp_path / "ckpt" / "epoch=0-step=10.ckpt"
    assert path.exists()

    L.seed_everything(123)  # a different seed: everything must come from the checkpoint
    second = LossRecorder()
    _trainer(tmp_path / "c", 20, [second]).fit(_module(), data(), ckpt_path=str(path))
    assert len(first.losses) == 10 and len(second.losses) == 10
    torch.testing.assert_close(torch.tensor(first.losses + second.losses), torch.tensor(straight.losses),
                               rtol=1e-6, atol=1e-6)


def test_sequence_longer_than_block_size_is_refused():
    model = GPTLightningModule(GPTConfig.from_name("tiny", block_size=16))
    data = TokenDataModule(source="synthetic", vocab_size=260, seq_len=32, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, limit_val_batches=0)
    with pytest.raises(ValueError, match="seq_len=32 is longer than the model's block_size=16"):
        trainer.fit(model, data)


def test_vocab_smaller_than_the_tokenizer_is_refused():
    with pytest.raises(ValueError, match="260"):
        TokenDataModule(source="builtin", vocab_size=100, seq_len=16, batch_size=2).setup("fit")
    # a model whose vocabulary cannot hold the data's tokens
    model = GPTLightningModule("tiny", vocab_size=200)
    data = TokenDataModule(source="builtin", seq_len=16, batch_size=2, builtin_max_bytes=50_000)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"model's vocab_size \(200\) is smaller than the builtin data's \(260\)"):
        trainer.fit(model, data)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_freed_after_each_step_train_like_lightnings_order(accumulate):
    """Gradients are freed right after the optimizer step (not after the next forward), and training,
    with gradient accumulation and clipping, ends at the parameters of Lightning's own zero_grad order."""
    from lightning.pytorch import LightningModule

    batches = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(4 * accumulate)]
    seen = []

    class GradsAtBatchStart(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % accumulate == 0:
                seen.append(all(p.grad is None for p in pl_module.parameters()))

    class LightningOrder(GPTLightningModule):
        optimizer_step = LightningModule.optimizer_step
        optimizer_zero_grad = LightningModule.optimizer_zero_grad

    def fit(cls, callbacks):
        torch.manual_seed(0)
        m = cls("tiny-llama", vocab_size=64, learning_rate=1e-2, warmup_steps=0, lr_decay_steps=1000, fused_adam=False)
        L.Trainer(accelerator="cpu", max_steps=4, accumulate_grad_batches=accumulate, gradient_clip_val=1.0,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, callbacks=callbacks).fit(m, torch.utils.data.DataLoader(batches, batch_size=None))
        return m

    ours, reference = fit(GPTLightningModule, [GradsAtBatchStart()]), fit(LightningOrder, [])
    assert seen == [True] * 4
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_fused_adam_default_follows_where_the_step_runs() -> None:
    from types import SimpleNamespace

    from lightning_perf.models import GPTLightningModule

    module = GPTLightningModule("tiny", lr_decay_steps=10)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is False  # CPU training: the per-tensor loop
    # parameters in host memory beside a GPU (CPU offload): torch's fused CPU kernel
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    try:
        assert module.configure_optimizers()["optimizer"].defaults["fused"] is True
        module._trainer.strategy.root_device = torch.device("cpu")
        assert module.configure_optimizers()["optimizer"].defaults["fused"] is False
    finally:
        module._trainer = None
    explicit = GPTLightningModule("tiny", fused_adam=True, lr_decay_steps=10)
    explicit.configure_model()
    assert explicit.configure_optimizers()["optimizer"].defaults["fused"] is True  # asked for: kept on the CPU
