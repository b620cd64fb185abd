"""RooflineMonitor on CPU with explicit peaks: matmul-heavy vs elementwise-chain toys, PNG + JSON."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from callback_toys import trainer
from lightning_perf.callbacks import RooflineMonitor

# Peaks chosen for a CPU: ridge point at 1 FLOP/byte.
PEAKS = dict(peak_flops=1e9, peak_bandwidth=1e9)


class MatmulToy(L.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class ElementwiseToy(L.LightningModule):
    """A chain of elementwise ops on a long vector: about one FLOP per 8+ bytes moved."""

    def __init__(self, n: int = 1 << 18) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def training_step(self, batch, batch_idx):
        x = batch[0].reshape(-1) * self.scale
        for _ in range(6):
            x = torch.nn.functional.gelu(x * 1.01 + 0.1)
        return x.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _data(shape, n=4):
    return DataLoader(TensorDataset(torch.randn(n, *shape)), batch_size=1)


def _is_png(path: str) -> bool:
    import matplotlib.image as mpimg

    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return False
    image = mpimg.imread(path)
    return image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_matmul_toy_is_compute_bound(tmp_path):
    width = 512  # large enough that the matmuls dominate the profiled step's time on a busy 2-core runner
    mon = RooflineMonitor(start_step=1, **PEAKS)
    trainer(tmp_path, [mon], max_steps=4).fit(MatmulToy(width), _data((width, width)))
    assert len(mon.results) == 1
    result = mon.results[0]
    cats = {g["name"]: g for g in result["categories"]}
    assert cats["matmul"]["bound"] == "compute"
    assert cats["matmul"]["intensity"] > 10
    # 4 matmuls forward; backward: 4 weight grads + 3 input grads (the data needs none)
    assert cats["matmul"]["flops"] == 11 * 2 * width**3
    assert result["bound"] == "compute"
    png = os.path.join(str(tmp_path), "roofline_step1.png")
    assert _is_png(png)
    with open(os.path.join(str(tmp_path), "roofline_step1.json")) as f:
        assert json.load(f)["categories"][0]["name"] == "matmul"
    modules = {g["name"] for g in result["modules"]}
    assert any(m.startswith("MatmulToy.layers") for m in modules), modules


def test_elementwise_chain_is_memory_bound(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    mon = RooflineMonitor(start_step=0, **PEAKS)
    trainer(tmp_path, [mon], max_steps=3, logger=logger).fit(ElementwiseToy(), _data((1 << 18,)))
    result = mon.results[0]
    cats = {g["name"]: g for g in result["categories"]}
    assert cats["elementwise"]["bound"] == "memory"
    assert cats["elementwise"]["intensity"] < 1
    assert result["bound"] == "memory"
    assert _is_png(os.path.join(logger.log_dir, "roofline_step0.png"))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logger.log_dir))


def test_cpu_without_peaks_is_disabled(tmp_path):
    mon = RooflineMonitor(start_step=0)
    with pytest.warns(UserWarning, match="peak_flops"):
        trainer(tmp_path, [mon], max_steps=2).fit(MatmulToy(width=16), _data((4, 16)))
    assert mon.results == []
