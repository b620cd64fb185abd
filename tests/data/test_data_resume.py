"""Mid-epoch resume through a real ``lightning.Trainer`` (CPU).

An uninterrupted 2-epoch run saves a checkpoint after every step; runs resumed from
some of them (``Trainer.fit(ckpt_path=...)``) must see exactly the samples the
uninterrupted run saw after that step: none repeated, none skipped.
"""

from __future__ import annotations

import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_perf.data import TokenDataModule, write_token_file

SEQ_LEN, BATCH, SAMPLES = 4, 4, 40  # 10 batches per epoch


class RecordingModule(L.LightningModule):
    """Trains one scalar; records which windows each step saw. The token files hold
    0, 1, 2, ... so window ``i`` starts with token ``i * SEQ_LEN``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert torch.equal(x[:, 1:], y[:, :-1])
        self.seen.append((x[:, 0] // SEQ_LEN).tolist())
        return (self.w - x.float().mean() / 100) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def arange_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("arange")
    n = SAMPLES * SEQ_LEN + 1
    write_token_file(root / "train", np.arange(n), vocab_size=n)
    write_token_file(root / "val", np.arange(2 * SEQ_LEN + 1), vocab_size=n)
    return root


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **({"enable_checkpointing": False} if "callbacks" not in kwargs else {}),
        **kwargs,
    )


def _data(arange_dir, num_workers):
    return TokenDataModule(source="memmap", data_dir=str(arange_dir), seq_len=SEQ_LEN, batch_size=BATCH,
                           num_workers=num_workers, seed=7)


# 4: inside epoch 0; 10: exactly at the epoch boundary; 13: inside epoch 1 (with worker processes too)
@pytest.mark.parametrize("num_workers, resume_steps", [(0, (4, 10, 13)), (2, (13,))])
def test_resume_mid_epoch_continues_with_the_next_sample(arange_dir, tmp_path, num_workers, resume_steps):
    ckpts = tmp_path / "ckpts"
    full = RecordingModule()
    every_step = ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    _trainer(callbacks=[every_step]).fit(full, _data(arange_dir, num_workers))

    # the uninterrupted run: each epoch visits all 40 windows once, in a different order
    assert len(full.seen) == 20
    epochs = [sum(full.seen[:10], []), sum(full.seen[10:], [])]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(SAMPLES))
    assert epochs[0] != epochs[1]

    # Lightning asked the loader for its state: (epoch, samples consumed) is in the checkpoint
    state = torch.load(ckpts / "step=13.ckpt", weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert [(s["epoch"], s["consumed"]) for s in state["combined_loader"]] == [(1, 3 * BATCH)]

    for step in resume_steps:
        resumed = RecordingModule()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer().fit(resumed, _data(arange_dir, num_workers), ckpt_path=ckpts / f"step={step}.ckpt")
        assert not [w for w in caught if "not resumable" in str(w.message)]
        assert resumed.seen == full.seen[step:], f"resumed from step {step}"
        assert float(resumed.w.detach()) == pytest.approx(float(full.w.detach()), abs=1e-6)


def test_plain_dataloader_would_restart_the_epoch(arange_dir, tmp_path):
    """Control: the same runs with a torch DataLoader (no state) do not continue where
    they stopped, which is what the test above guards against."""

    class PlainData(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.inner = _data(arange_dir, 0)

        def setup(self, stage):
            self.inner.setup(stage)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(7)
            return torch.utils.data.DataLoader(self.inner.train_dataset, batch_size=BATCH, shuffle=True, generator=g)

    ckpts = tmp_path / "ckpts"
    full = RecordingModule()
    _trainer(callbacks=[ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=4, save_top_k=-1)]).fit(
        full, PlainData()
    )
    resumed = RecordingModule()
    with pytest.warns(UserWarning, match="not resumable"):
        _trainer().fit(resumed, PlainData(), ckpt_path=ckpts / "step=4.ckpt")
    assert resumed.seen != full.seen[4:]


def test_gpt_losses_match_after_resume(tmp_path):
    """The pack's GPT module on the built-in corpus: the losses after resuming from the
    checkpoint of step 4 equal those of the uninterrupted run (same LR schedule: the
    checkpoint comes from that run)."""
    from lightning_perf.models.gpt.config import GPTConfig
    from lightning_perf.models.gpt.module import GPTLightningModule

    config = GPTConfig.from_name("tiny").replace(n_layer=2, n_head=2, n_kv_head=2, n_embd=32, block_size=32, vocab_size=260)

    class LossRecorder(L.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    def run(ckpt_path=None, callbacks=()):
        L.seed_everything(0, verbose=False)
        model = GPTLightningModule(config, warmup_steps=2)
        data = TokenDataModule(source="builtin", seq_len=32, batch_size=4, builtin_max_bytes=300_000, seed=1)
        rec = LossRecorder()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            enable_checkpointing=bool(callbacks), callbacks=[rec, *callbacks])
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return rec.losses

    full = run(callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)])
    resumed = run(ckpt_path=tmp_path / "step=4.ckpt")
    assert len(full) == 8 and len(resumed) == 4
    assert resumed == pytest.approx(full[4:], rel=1e-6, abs=1e-6)
