"""The progress bar of ``lightning-perf``: a run bounded by ``max_steps`` counts its steps, not the epoch's batches.

The recipes bound training by ``trainer.max_steps`` (``max_epochs`` left at -1), where Lightning's bars read
``Epoch 0/-2`` and count the batches of each epoch from zero again. These bars show ``Step`` with the optimizer
step out of ``max_steps`` in one bar across epochs (a resumed run starts at its step), and leave out the logger's
version number (``v_num``: the directories it names are printed when ``fit`` ends). A run bounded by epochs
keeps Lightning's display. Rich's bar where ``rich`` is installed, tqdm's otherwise, as Lightning chooses.
"""

from __future__ import annotations

from abc import abstractmethod

from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

__all__ = ["StepRichProgressBar", "StepTQDMProgressBar", "step_progress_bar", "counts_steps"]

STEP_DESCRIPTION = "Step"


def counts_steps(trainer: "pl.Trainer") -> bool:
    """Whether ``trainer`` stops at ``max_steps`` with no bound on epochs (Lightning's ``max_epochs`` -1 or None)."""
    return trainer.max_steps is not None and trainer.max_steps > 0 and trainer.max_epochs in (None, -1)


class _StepCounting:
    """What both bars change: in a step-bounded run, one training bar at ``global_step / max_steps``;
    without a bound on epochs no ``/-2``; no ``v_num``."""

    _bar_started = False  # the step-counting bar is set up (once per fit, not once per epoch)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        self._bar_started = False

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not counts_steps(trainer):
            super().on_train_epoch_start(trainer, pl_module)  # type: ignore[misc]
            if trainer.max_epochs == -1:  # bounded by time (or by nothing): Lightning's reads 'Epoch 0/-2'
                self._describe_train_bar(f"Epoch {trainer.current_epoch}")
            return
        if self._bar_started:  # the same bar goes on across epochs
            return
        super().on_train_epoch_start(trainer, pl_module)  # type: ignore[misc]
        self._start_at_step(trainer.global_step, trainer.max_steps)
        self._bar_started = True

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if counts_steps(trainer):
            if not self._bar_started:  # a run resumed mid-epoch may start without on_train_epoch_start
                self.on_train_epoch_start(trainer, pl_module)
            # Lightning's bars draw position batch_idx + 1; here the position is the optimizer step
            batch_idx = trainer.global_step - 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]

    @property
    @override
    def total_train_batches(self) -> Union[int, float]:
        trainer = self.trainer  # type: ignore[attr-defined]
        if counts_steps(trainer):
            return trainer.max_steps
        return super().total_train_batches  # type: ignore[misc]

    @override
    def get_metrics(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule"
    ) -> dict[str, Union[int, str, float, dict[str, float]]]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        items.pop("v_num", None)
        return items

    def _step_description(self) -> str:
        # as wide as the validation bar's, as Lightning pads 'Epoch N', so the columns do not shift
        return f"{STEP_DESCRIPTION:{len(self.validation_description)}}"  # type: ignore[attr-defined]

    # each bar below (Rich, tqdm) sets its own widget's position and text
    @abstractmethod
    def _start_at_step(self, step: int, max_steps: int) -> None:
        """Put the training bar at ``step`` of ``max_steps``."""

    @abstractmethod
    def _describe_train_bar(self, description: str) -> None:
        """Set the training bar's description."""


class StepRichProgressBar(_StepCounting, RichProgressBar):
    """Lightning's Rich progress bar counting the steps of a step-bounded run (see the module docstring)."""

    @override
    def _start_at_step(self, step: int, max_steps: int) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        # reset, not update: a jump from 0 to the resumed step must not count as speed
        self.progress.reset(self.train_progress_bar_id, total=max_steps, completed=step,
                            description=self._step_description(), visible=True)
        self.refresh()

    @override
    def _describe_train_bar(self, description: str) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=description)


class StepTQDMProgressBar(_StepCounting, TQDMProgressBar):
    """Lightning's tqdm progress bar counting the steps of a step-bounded run (see the module docstring)."""

    @override
    def _start_at_step(self, step: int, max_steps: int) -> None:
        bar = self.train_progress_bar
        bar.reset(total=max_steps)
        bar.initial = bar.n = step  # a resumed run's rate counts only its own steps
        bar.set_description(STEP_DESCRIPTION)

    @override
    def _describe_train_bar(self, description: str) -> None:
        pass  # tqdm's already reads 'Epoch N'


def step_progress_bar() -> ProgressBar:
    """The Rich bar where ``rich`` is installed, else the tqdm bar (Lightning's own choice of default)."""
    try:
        return StepRichProgressBar()
    except ModuleNotFoundError:  # RichProgressBar refuses to build without rich
        return StepTQDMProgressBar()
