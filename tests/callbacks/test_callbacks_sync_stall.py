"""SyncPointWarner (planted .item() and nonzero, clean step, error mode) and DataLoaderStallDetector."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from callback_toys import V, ToyLM, WallTimes, loader, trainer
from lightning_perf.callbacks import DataLoaderStallDetector, SyncPointError, SyncPointWarner, SyncPointWarning

HERE = os.path.basename(__file__)


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


class PlantedSyncs(ToyLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, V), y.reshape(-1))
        if loss.item() > 1e9:  # PLANTED-ITEM
            print("diverged")
        picked = torch.nonzero(y > 3)  # PLANTED-NONZERO
        return loss + 0.0 * picked.numel()


def test_planted_syncs_are_reported_at_their_lines(tmp_path):
    warner = SyncPointWarner(every_n_steps=2, start_step=1)
    with pytest.warns(SyncPointWarning) as caught:
        trainer(tmp_path, [warner], max_steps=4).fit(PlantedSyncs(), loader())
    messages = [str(w.message) for w in caught if issubclass(w.category, SyncPointWarning)]
    item_at = f"{HERE}:{_line_of('PLANTED-ITEM')}"
    nonzero_at = f"{HERE}:{_line_of('PLANTED-NONZERO')}"
    assert any(item_at in m and "item" in m for m in messages), messages
    assert any(nonzero_at in m and "nonzero" in m for m in messages), messages
    assert len(messages) == 2  # once per site, although two steps were sampled
    assert warner.sampled_steps == [1, 3]
    sites = {s.location.split(os.sep)[-1]: s for s in warner.user_sites()}
    assert sites[item_at].count == 2 and sites[nonzero_at].count == 2


def test_clean_step_reports_nothing(tmp_path):
    warner = SyncPointWarner(every_n_steps=1, start_step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SyncPointWarning)
        trainer(tmp_path, [warner], max_steps=3).fit(ToyLM(), loader())
    assert warner.sampled_steps == [0, 1, 2]
    assert warner.user_sites() == []


def test_error_mode_raises_at_the_site(tmp_path):
    warner = SyncPointWarner(mode="error", every_n_steps=0, start_step=1)
    with pytest.raises(SyncPointError, match=f"{HERE}:{_line_of('PLANTED-ITEM')}"):
        trainer(tmp_path, [warner], max_steps=3).fit(PlantedSyncs(), loader())
    # the detector was removed on the way out
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_framework_sync_is_separated_from_user_code(tmp_path):
    class LogsWithSync(ToyLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss, prog_bar=True)  # the progress bar converts it with .item()
            return loss

    warner = SyncPointWarner(every_n_steps=1, start_step=0)
    trainer(tmp_path, [warner], max_steps=2, enable_progress_bar=True).fit(LogsWithSync(), loader())
    assert warner.user_sites() == []
    framework = warner.framework_sites()
    assert framework and all("lightning" in s.location for s in framework)


@pytest.mark.parametrize("data_sleep", [0.0, 0.08])
def test_stall_fraction_matches_injected_sleep(tmp_path, data_sleep):
    B, step_sleep, warmup = 2, 0.08, 3
    det = DataLoaderStallDetector(window=2, warmup_steps=warmup)
    ref = WallTimes(time.perf_counter)
    # every sample sleeps data_sleep / B, so one batch fetch sleeps data_sleep
    trainer(tmp_path, [ref, det], max_steps=10).fit(ToyLM(step_sleep=step_sleep),
                                                    loader(batch_size=B, sleep=data_sleep / B))
    assert det.run_window().steps == 10 - warmup  # the last step ends at its batch end
    assert len(det.fractions) == 3  # logged every 2 measured steps; the last one resolves at the end
    # the injected wait's share of the real wall time: one fetch after each measured step but the last
    injected = data_sleep * (10 - warmup - 1) / sum(ref.step(i) for i in range(warmup, 10))
    if data_sleep:
        assert det.stall_fraction == pytest.approx(injected, rel=0.2)
        assert det.warned and any("num_workers=0" in a for a in det.advice)
    else:  # what remains is the loader's own fetch and collate (~1-3% of an 80 ms step, by machine load):
        # below the share the detector warns at, and no warning
        assert det.stall_fraction < det.threshold
        assert not det.warned
