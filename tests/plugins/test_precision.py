"""PerfPrecision and DistributedLossScaler in one process, against GradScaler-style arithmetic."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_perf.parallel.loss_scaler import DistributedLossScaler
from lightning_perf.plugins import PerfPrecision


def test_modes_and_policies() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert PerfPrecision("bf16-mixed").mp_policy() == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert PerfPrecision("16-mixed").mp_policy() == MixedPrecisionPolicy(torch.float16, torch.float32)
    assert PerfPrecision("32-true").mp_policy() == MixedPrecisionPolicy()
    assert PerfPrecision("bf16-true").mp_policy() == MixedPrecisionPolicy()
    assert PerfPrecision("16-mixed").scaler is not None and PerfPrecision("bf16-mixed").scaler is None
    m = PerfPrecision("bf16-true").convert_module(torch.nn.Linear(2, 2))
    assert m.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="choose one of"):
        PerfPrecision("16-true")


def test_scale_loss_only_under_fp16() -> None:
    loss = torch.tensor(3.0)
    assert PerfPrecision("16-mixed", init_scale=8.0).scale_loss(loss).item() == 24.0
    assert PerfPrecision("bf16-mixed").scale_loss(loss) is loss


def test_autocast_only_on_the_unsharded_path() -> None:
    p = PerfPrecision("bf16-mixed", device_type="cpu")
    lin = torch.nn.Linear(4, 4)
    with p.forward_context():
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    p.sharded_casting = True  # FSDP2's MixedPrecisionPolicy casts instead
    with p.forward_context():
        assert lin(torch.randn(2, 4)).dtype == torch.float32


def test_scaler_growth_backoff_and_state() -> None:
    s = DistributedLossScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([4.0, 8.0, -4.0])
    assert s.unscale_([p]) is False
    assert p.grad.tolist() == [1.0, 2.0, -1.0]
    s.update(False)
    s.update(False)
    assert s.loss_scale == 8.0  # grew after 2 clean steps
    p.grad = torch.tensor([float("nan"), 1.0, 1.0])
    assert s.unscale_([p]) is True
    s.update(True)
    assert s.loss_scale == 4.0 and s.skipped_steps == 1
    state = s.state_dict()
    t = DistributedLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state
    with pytest.raises(ValueError, match="backoff_factor"):
        DistributedLossScaler(backoff_factor=1.5)


class _Tiny(L.LightningModule):
    def __init__(self, inf_at: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.inf_at = inf_at
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.weights.append(self.lin.weight.detach().clone())
        return self.lin(batch[0]).float().pow(2).mean()

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.inf_at:
            self.lin.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fp16_step_skipped_on_overflow_inside_trainer(tmp_path) -> None:
    L.seed_everything(0)
    model = _Tiny(inf_at=2)
    plugin = PerfPrecision("16-mixed", init_scale=256.0, growth_interval=100)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, plugins=[plugin], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    assert plugin.scaler.skipped_steps == 1 and plugin.loss_scale == 128.0
    w = model.weights
    assert torch.equal(w[2], w[3])  # step 2 skipped: weights unchanged
    assert not torch.equal(w[1], w[2]) and torch.isfinite(model.lin.weight).all()
    assert trainer.callback_metrics["precision/loss_scale"].item() == 128.0
    # scaler state goes into the checkpoint and comes back
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert ckpt["PerfPrecision"]["scaler"]["scale"] == 128.0
