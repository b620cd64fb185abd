"""What ``lightning-perf fit`` shows while it trains: the step-counting progress bar, and Lightning's notices
that a user cannot act on left out (and only those)."""

from __future__ import annotations

import logging
import warnings

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_perf.cli.perf_cli import _with_step_progress_bar
from lightning_perf.cli.progress import StepRichProgressBar, StepTQDMProgressBar, step_progress_bar
from lightning_perf.cli.quiet import lightning_notices_filtered

BATCHES = 3  # per epoch: a run of 7 steps crosses two epoch boundaries


class _Model(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 2 * BATCHES), batch_size=2)

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 4), batch_size=2)


class _Seen(Callback):
    """After the bar's own hook (it runs later in the list): where the training bar stands."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, *args):
        if isinstance(self.bar, RichProgressBar):
            task = next(t for t in self.bar.progress.tasks if t.id == self.bar.train_progress_bar_id)
            self.seen.append((int(task.completed), task.total, task.description.strip()))
        else:
            tq = self.bar.train_progress_bar
            self.seen.append((tq.n, tq.total, tq.desc.split(":")[0]))


def _fit(bar, tmp_path, ckpt_path=None, **trainer_kwargs):
    seen = _Seen(bar)
    trainer = Trainer(accelerator="cpu", callbacks=[bar, seen], logger=CSVLogger(tmp_path), limit_val_batches=1,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                      **trainer_kwargs)
    trainer.fit(_Model(), ckpt_path=ckpt_path)
    return trainer, seen.seen


@pytest.mark.parametrize("bar_class", [StepRichProgressBar, StepTQDMProgressBar])
def test_a_step_bounded_run_counts_steps_across_epochs(bar_class, tmp_path):
    bar = bar_class()
    trainer, seen = _fit(bar, tmp_path, max_steps=7, val_check_interval=2)
    assert trainer.current_epoch >= 2  # the steps crossed two epoch boundaries
    # one bar from step 1 to 7 of 7, not 1..3 of each epoch as Lightning's 'Epoch 0/-2' bar shows
    assert [s[:2] for s in seen] == [(i, 7) for i in range(1, 8)]
    assert {s[2] for s in seen} == {"Step"}
    assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)
    assert trainer.loggers[0].version == 0  # there was a version to show

    # resumed: the bar starts at the checkpoint's step
    ckpt = tmp_path / "step4.ckpt"
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Model())
    trainer.save_checkpoint(ckpt)
    _, seen = _fit(bar_class(), tmp_path, ckpt_path=ckpt, max_steps=7, val_check_interval=2)
    assert [s[:2] for s in seen] == [(5, 7), (6, 7), (7, 7)]


@pytest.mark.parametrize("bar_class", [StepRichProgressBar, StepTQDMProgressBar])
def test_an_epoch_bounded_run_keeps_lightnings_bar(bar_class, tmp_path):
    trainer, seen = _fit(bar_class(), tmp_path, max_epochs=2)
    assert [s[:2] for s in seen] == [(i, BATCHES) for i in range(1, BATCHES + 1)] * 2
    assert seen[0][2] == ("Epoch 0/1" if bar_class is StepRichProgressBar else "Epoch 0")


def test_the_cli_adds_its_bar_unless_one_is_given_or_bars_are_off():
    assert isinstance(step_progress_bar(), (StepRichProgressBar, StepTQDMProgressBar))
    added = _with_step_progress_bar({"callbacks": None})["callbacks"]
    assert len(added) == 1 and isinstance(added[0], (StepRichProgressBar, StepTQDMProgressBar))
    other = Callback()
    assert _with_step_progress_bar({"callbacks": [other]})["callbacks"][0] is other
    assert _with_step_progress_bar({"callbacks": [TQDMProgressBar()]}) == {}
    assert _with_step_progress_bar({"callbacks": None, "enable_progress_bar": False}) == {}


def test_only_lightnings_unactionable_notices_are_left_out(caplog):
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    tip = ("💡 Tip: For seamless cloud logging and experiment tracking, try installing "
           "[litlogger](https://pypi.org/project/litlogger/) to enable LitLogger, which logs metrics.")
    models_tip = ("💡 Tip: For seamless cloud uploads and versioning, try installing "
                  "[litmodels](https://pypi.org/project/litmodels/) to enable LitModelCheckpoint.")
    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lightning_notices_filtered():
                rank_zero_info(tip)
                rank_zero_info(models_tip)
                rank_zero_info("GPU available: False, used: False")
                warnings.warn_explicit(leaf, FutureWarning, "_pytree.py", 21,
                                       module="lightning.pytorch.utilities._pytree")
                warnings.warn_explicit(leaf, FutureWarning, "mine.py", 1, module="my_project.trees")
                warnings.warn_explicit("something else is deprecated", FutureWarning, "_pytree.py", 22,
                                       module="lightning.pytorch.utilities._pytree")
            rank_zero_info(tip)  # after the block, the filters are gone
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False", tip]
    # the LeafSpec warning from Lightning's module only: the same text from elsewhere and other warnings stay
    assert [(str(w.message), w.filename) for w in caught] == [(leaf, "mine.py"),
                                                               ("something else is deprecated", "_pytree.py")]
