"""The benchmarks' wall-clock window (``benchmarks/_timing.py``): the headline is the tokens over the
window's wall time, the median / p90 / slowest step sit beside it, and what happened inside the
window (garbage collections, Dynamo recompilations) is recorded, nothing from outside it."""

import gc
import math
import time

import lightning as L
import pytest
import torch
from _timing import WallClockWindow, Window, window_stats
from torch.utils.data import DataLoader, TensorDataset


def _assert_headline(result: dict, tokens: int, steps: int) -> None:
    assert result["steps_timed"] == steps and result["tokens"] == tokens
    assert result["tokens_per_s"] == pytest.approx(tokens / result["wall_s"], rel=1e-12)
    assert result["step_ms_mean"] * steps == pytest.approx(1e3 * result["wall_s"], rel=1e-12)
    # every step lies inside the window: none is longer than it
    assert result["step_ms_median"] <= result["step_ms_p90"] <= result["step_ms_max"] <= 1e3 * result["wall_s"]


def test_window_stats_reference():
    stats = window_stats(1.0, [0.1] * 8 + [0.3, 0.5], 2000)
    assert stats["tokens_per_s"] == 2000.0 and stats["step_ms_mean"] == 100.0
    assert stats["step_ms_median"] == pytest.approx(100.0)
    assert stats["step_ms_p90"] == pytest.approx(500.0) and stats["step_ms_max"] == pytest.approx(500.0)


def test_window_counts_slow_steps_collections_and_recompiles_inside_it_only():
    calls = []
    double = torch.compile(lambda t: t * 2, backend="eager", dynamic=False)
    double(torch.ones(2))  # compiled before the window: not a recompilation inside it
    window = Window(cuda=False, barrier=lambda: calls.append(time.perf_counter()), first_step=5)
    gc.disable()
    try:
        gc.collect()  # before the window
        window.open()
        naps = [0.01, 0.01, 0.15, 0.01]
        for i, nap in enumerate(naps):
            window.step(tokens=64)
            time.sleep(nap)
            if i == 1:
                double(torch.ones(3))  # a new shape: one recompilation, at step 6
            if i == 2:
                gc.collect()
        result = window.close()
        gc.collect()  # after the window
    finally:
        gc.enable()
        torch._dynamo.reset()
    _assert_headline(result, tokens=4 * 64, steps=4)
    assert result["wall_s"] >= sum(naps)
    assert result["slowest_steps"][0]["step"] == 7 and result["step_ms_max"] >= 150.0
    assert result["step_ms_median"] < 150.0
    # the full collection at step 7, not those before and after the window (Dynamo may add young ones)
    assert [g["step"] for g in result["gc_in_window"] if g["generation"] == 2] == [7]
    assert all(5 <= g["step"] <= 8 for g in result["gc_in_window"])
    assert result["gc_count_in_window"] == len(result["gc_in_window"])
    assert math.isclose(result["gc_ms_in_window"], sum(g["ms"] for g in result["gc_in_window"]), abs_tol=0.05)
    assert result["recompiles_in_window"] == 1 and result["graph_breaks_in_window"] == 0
    # the barrier at both ends, inside the wall-clock span
    assert len(calls) == 2
    assert result["peak_mem_gb"] is None  # no CUDA device here
    assert window.close() is result


def test_window_refuses_misuse():
    window = Window(cuda=False)
    with pytest.raises(RuntimeError, match="between open"):
        window.step(1)
    window.open()
    with pytest.raises(RuntimeError, match="opens once"):
        window.open()
    with pytest.raises(RuntimeError, match="at least one step"):
        window.close()


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_wall_clock_window_times_the_steps_after_warmup_and_stops_after_steps(tmp_path):
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    callback = WallClockWindow(warmup=2, steps=3, checkpoint=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[callback])
    barriers = []
    barrier = trainer.strategy.barrier
    trainer.strategy.barrier = lambda *a, **k: (barriers.append(trainer.global_step), barrier(*a, **k))
    trainer.fit(_Regression(), DataLoader(data, batch_size=4))
    result = callback.result
    # steps 2, 3 and 4 of 7, each a batch of 4 x 8 inputs
    _assert_headline(result, tokens=3 * 4 * 8, steps=3)
    assert {s["step"] for s in result["slowest_steps"]} == {2, 3, 4}
    assert 2 in barriers and 5 in barriers  # opened at the start of step 2, closed at the end of step 4
    assert result["checkpoint_save_s"] is None and result["strategy"] == "SingleDeviceStrategy"
    for key in ("gc_in_window", "gc_count_in_window", "recompiles_in_window", "graph_breaks_in_window"):
        assert key in result


def test_wall_clock_window_marks_optimizer_steps_under_accumulation(tmp_path):
    """With 4 micro-batches per optimizer step, a step's mark and tokens are those of all four."""
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    callback = WallClockWindow(warmup=1, steps=2, checkpoint=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(_Regression(), DataLoader(data, batch_size=4))
    _assert_headline(callback.result, tokens=2 * 4 * 4 * 8, steps=2)
    assert {s["step"] for s in callback.result["slowest_steps"]} == {1, 2}


@pytest.mark.parametrize("warmup,steps,max_steps", [(4, None, 4), (2, 3, 4), (2, 0, 6)])
def test_wall_clock_window_refuses_a_window_outside_the_fit(warmup, steps, max_steps, tmp_path):
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[WallClockWindow(warmup=warmup, steps=steps, checkpoint=False)])
    with pytest.raises(ValueError, match=f"times steps {warmup} to .* but the fit runs steps 0 to {max_steps - 1}"):
        trainer.fit(_Regression(), DataLoader(data, batch_size=4))
