"""SyncPointWarner on a CPU run: one tiny module per sync kind, each reported with its kind at its line.

The CUDA-only calls (``torch.cuda.synchronize``, ``Stream``/``Event.synchronize``) are replaced by
stand-ins that do nothing, so the wrappers the warner installs around them are what is tested.
"""

from __future__ import annotations

import os

import pytest
import torch

from callback_toys import ToyLM, loader, trainer
from lightning_perf.callbacks import SyncPointWarner

HERE = os.path.basename(__file__)


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if f"# {marker}" in line:
                return i
    raise AssertionError(marker)


class Planted(ToyLM):
    """Plants one synchronising line (``plant``) after the loss."""

    def __init__(self, plant: str) -> None:
        super().__init__()
        self.plant = plant
        self.host = torch.ones(8)  # a plain host tensor (not a buffer: Lightning leaves it where it is)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        x, y = batch
        getattr(self, f"_{self.plant}")(loss.detach(), x, y)
        return loss

    def _item(self, loss, x, y):
        loss.item()  # PLANT-item

    def _tolist(self, loss, x, y):
        loss.reshape(1).tolist()  # PLANT-tolist

    def _bool(self, loss, x, y):
        if loss > 1e9:  # PLANT-bool
            raise RuntimeError("diverged")

    def _cpu(self, loss, x, y):
        loss.cpu()  # PLANT-cpu

    def _to_host(self, loss, x, y):
        loss.to("cpu")  # PLANT-to_host

    def _pageable_h2d(self, loss, x, y):
        self.host.to(self.device, non_blocking=True)  # PLANT-pageable_h2d

    def _nonzero(self, loss, x, y):
        torch.nonzero(y > 3)  # PLANT-nonzero

    def _mask(self, loss, x, y):
        x[y > 3]  # PLANT-mask

    def _cuda_synchronize(self, loss, x, y):
        torch.cuda.synchronize()  # PLANT-cuda_synchronize

    def _stream_synchronize(self, loss, x, y):
        torch.cuda.Stream.synchronize(None)  # PLANT-stream_synchronize

    def _event_synchronize(self, loss, x, y):
        torch.cuda.Event.synchronize(None)  # PLANT-event_synchronize

    def _cpu_synchronize(self, loss, x, y):
        torch.cpu.synchronize()  # PLANT-cpu_synchronize


KINDS = {
    "item": "scalar", "tolist": "scalar", "bool": "scalar",
    "cpu": "d2h_copy", "to_host": "d2h_copy", "pageable_h2d": "pageable_h2d",
    "nonzero": "data_dependent", "mask": "data_dependent",
    "cuda_synchronize": "synchronize", "stream_synchronize": "synchronize", "event_synchronize": "synchronize",
    "cpu_synchronize": "synchronize",
}


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    """What the CUDA calls would be on a GPU, minus the waiting."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: None)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: None)


@pytest.mark.parametrize("plant", sorted(KINDS))
def test_each_kind_is_reported_at_its_line(tmp_path, cuda_stand_ins, plant):
    warner = SyncPointWarner(every_n_steps=0, start_step=1)
    with pytest.warns(UserWarning, match="SyncPointWarner"):
        trainer(tmp_path, [warner], max_steps=2).fit(Planted(plant), loader())
    assert warner.sampled_steps == [1]
    [site] = warner.user_sites()  # the planted line and nothing else of the user's
    assert site.kind == KINDS[plant], site.describe()
    assert site.location == f"{__file__}:{_line_of('PLANT-' + plant)}"
    assert site.count == 1 and site.owner == "user"
    assert warner.sites_of_kind(KINDS[plant]) == [site]


def test_wrappers_are_removed_after_the_window(tmp_path, cuda_stand_ins):
    stand_in = torch.cuda.synchronize
    warner = SyncPointWarner(every_n_steps=0, start_step=0)
    trainer(tmp_path, [warner], max_steps=2).fit(Planted("cuda_synchronize"), loader())
    assert torch.cuda.synchronize is stand_in
    assert not {"tolist", "cpu", "to"} & set(vars(torch.Tensor))
    assert [s.count for s in warner.user_sites()] == [1]  # step 1 was not watched


def test_lightning_syncs_are_named_as_lightnings(tmp_path):
    class LogsOnTheBar(ToyLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss, prog_bar=True)  # the progress bar reads it with .item()
            return loss

    warner = SyncPointWarner(every_n_steps=1, start_step=0)
    trainer(tmp_path, [warner], max_steps=2, enable_progress_bar=True).fit(LogsOnTheBar(), loader())
    assert warner.user_sites() == []
    scalar = [s for s in warner.framework_sites() if s.kind == "scalar"]
    assert scalar and all(s.owner == "lightning" and os.sep + "lightning" in s.location for s in scalar)
    assert all("[lightning" in s.describe() for s in scalar)
