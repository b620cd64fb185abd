"""PerfPrecision and DistributedLossScaler in one process, against GradScaler-style arithmetic."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_perf.parallel.sharding.loss_scaler import DistributedLossScaler
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


# ---- gradient clipping folded into a fused Adam/AdamW step --------------------------------------


def _clip_then_step_pairs(n_steps: int, max_norm: float):
    from lightning_perf.plugins.precision import clear_folded_clip, fold_clip_into_fused_step

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt_ours = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1, fused=True)
    for i in range(n_steps):
        grads = [torch.randn_like(p) * (10.0 if i % 2 else 1e-3) for p in ref]  # clipped, then not
        for p, q, g in zip(ref, ours, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        opt_ref.step()
        assert fold_clip_into_fused_step(opt_ours, max_norm)
        assert opt_ours.grad_scale.item() == pytest.approx(max(1.0, (norm.item() + 1e-6) / max_norm), rel=1e-6)
        opt_ours.step()
        clear_folded_clip(opt_ours)
        assert opt_ours.grad_scale is None
        for p, q in zip(ref, ours):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)  # the gradients as clipped
    return opt_ours


def test_clip_folded_into_fused_adamw_equals_clip_then_step() -> None:
    opt = _clip_then_step_pairs(6, max_norm=1.0)
    assert opt.state[opt.param_groups[0]["params"][0]]["step"].item() == 6


def test_clip_fold_refuses_what_it_cannot_carry() -> None:
    from lightning_perf.plugins.precision import fold_clip_into_fused_step

    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    assert not fold_clip_into_fused_step(torch.optim.AdamW([p], fused=False), 1.0)  # unfused: clipped in place
    assert not fold_clip_into_fused_step(torch.optim.SGD([p], lr=0.1), 1.0)
    fused = torch.optim.AdamW([p], fused=True)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        assert not fold_clip_into_fused_step(fused, bad)
    fused.grad_scale = torch.tensor(8.0)  # a loss scaler's own divisor: left alone
    assert not fold_clip_into_fused_step(fused, 1.0) and fused.grad_scale.item() == 8.0
    fused.grad_scale = None
    p.grad = None
    assert not fold_clip_into_fused_step(fused, 1.0)


class _ClipModule(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).float().pow(2).mean() * 100.0  # large gradients: the clip acts
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def _fit_clipped(precision: str, *, fold: bool, manual: bool = False, monkeypatch=None,
                 device: str = "cpu") -> tuple[_ClipModule, int]:
    from lightning_perf.plugins import precision as precision_mod

    calls = []
    real = precision_mod.fold_clip_into_fused_step

    def counted(optimizer, max_norm):
        assert optimizer.param_groups[0]["params"][0].grad.device.type == device
        done = real(optimizer, max_norm) if fold else False
        calls.append(done)
        return done

    monkeypatch.setattr(precision_mod, "fold_clip_into_fused_step", counted)
    L.seed_everything(0)
    model = _ClipModule(manual)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 8)), batch_size=4)
    plugin = PerfPrecision(precision, device_type=device)
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else device, devices=1, max_steps=5, plugins=[plugin], logger=False,
                        gradient_clip_val=None if manual else 0.05, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    assert getattr(model.optimizers().optimizer, "grad_scale", None) is None  # nothing left behind
    return model, sum(calls)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_trainer_clipping_rides_on_the_fused_step(precision, monkeypatch) -> None:
    folded, n_folded = _fit_clipped(precision, fold=True, monkeypatch=monkeypatch)
    unfolded, n_unfolded = _fit_clipped(precision, fold=False, monkeypatch=monkeypatch)
    assert n_folded == 5 and n_unfolded == 0
    for a, b in zip(folded.parameters(), unfolded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(folded.net[0].weight, _ClipModule().net[0].weight)  # it trained
    # and the clip acted: its gradients' norm is far above 0.05
    model = _ClipModule()
    model.net(torch.randn(4, 8)).pow(2).mean().mul(100.0).backward()
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) > 1.0


def test_manual_optimization_clips_in_place(monkeypatch) -> None:
    # a user's clip_gradients before their own step leaves clipped gradients to inspect: no fold
    in_place = []
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: in_place.append(1) or real_clip(*a, **k))
    _, n_folded = _fit_clipped("32-true", fold=True, manual=True, monkeypatch=monkeypatch)
    assert n_folded == 0 and len(in_place) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_clip_fold_on_cuda_equals_clip_then_step(precision, monkeypatch) -> None:
    # torch's CUDA fused AdamW with the clip factor as its divisor, called on CUDA gradients every step
    folded, n_folded = _fit_clipped(precision, fold=True, monkeypatch=monkeypatch, device="cuda")
    unfolded, n_unfolded = _fit_clipped(precision, fold=False, monkeypatch=monkeypatch, device="cuda")
    assert n_folded == 5 and n_unfolded == 0
    for a, b in zip(folded.parameters(), unfolded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
