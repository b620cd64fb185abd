"""``NonFiniteGuard``: NaN/inf loss or gradients caught on the step they occur.

Each optimizer step, after the gradients are final (``on_before_optimizer_step``), one
device-side flag covers the loss and every gradient shard and is max-reduced over the
ranks (:func:`lightning_perf.parallel.reliability.numerics.nonfinite_flag`). The flag is read lazily
(:class:`~lightning_perf.parallel.reliability.numerics.FlagQueue`: a pinned non-blocking copy checked
with ``Event.query()`` at the next step; on CPU at once), so watching costs no host sync.
A bad step is warned about and logged (``numerics/nonfinite_step``) with its global step,
kept in :attr:`NonFiniteGuard.bad_steps`, then handled by ``policy``:

- ``"skip"``: the optimizer step is not taken (its gradients are dropped; AdamW then
  leaves every parameter and its moments untouched). Deciding *before* ``optimizer.step``
  is a host decision, so this policy reads the flag at once: one sync per step. Under
  fp16 (``PerfPrecision("16-mixed")``) the loss scaler already skips overflowing steps
  (it syncs for that anyway); the guard then only watches the loss.
- ``"stop"``: raise :class:`NonFiniteError` naming the step (on every rank at once).
- ``"rollback"``: reload model, optimizer and loss-scaler state from the last checkpoint
  (``ModelCheckpoint``'s latest save, or ``checkpoint=``) and continue with the next
  batches; the batches since that checkpoint are not replayed. Without a checkpoint, or
  if the checkpoint itself holds non-finite weights, it stops with a message saying how
  to resume. After ``max_rollbacks`` rollbacks in one run (3 by default) the next bad step
  stops it with :class:`NonFiniteError` naming the step and the count: a run that keeps
  diverging needs a lower learning rate or other data, not more rollbacks.
- ``"log"``: only warn and log.

Pending flags are read (waited for) before every checkpoint save, so a checkpoint is
never written after an unnoticed bad step: a bad step found then stops the run with
:class:`NonFiniteError` for ``stop`` and ``rollback`` (the weights being saved are bad).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_perf.parallel.reliability.numerics import FlagQueue, nonfinite_flag

__all__ = ["NonFiniteGuard", "NonFiniteError", "POLICIES"]

POLICIES = ("skip", "stop", "rollback", "log")


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or gradient (``step``: the global step)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class NonFiniteGuard(pl.Callback):
    """Detect non-finite loss/gradients per step and apply ``policy`` (see the module docstring).

    Args:
        policy: ``"skip"``, ``"stop"``, ``"rollback"`` or ``"log"``.
        checkpoint: for ``"rollback"``: the checkpoint to restore; default: the latest save
            of the Trainer's ``ModelCheckpoint``.
        max_pending: flags in flight before the oldest is waited for.
        max_rollbacks: for ``"rollback"``: how many rollbacks this callback makes before a bad step
            stops training instead (``None``: no limit).
    """

    def __init__(
        self,
        policy: Literal["skip", "stop", "rollback", "log"] = "stop",
        *,
        checkpoint: Optional[Union[str, Path]] = None,
        max_pending: int = 8,
        max_rollbacks: Optional[int] = 3,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if max_rollbacks is not None and (isinstance(max_rollbacks, bool) or not isinstance(max_rollbacks, int)
                                          or max_rollbacks < 0):
            raise ValueError(f"max_rollbacks must be an integer >= 0 or None, got {max_rollbacks!r}")
        self.max_rollbacks = max_rollbacks
        self.policy = policy
        self.checkpoint = checkpoint
        self.queue = FlagQueue(max_pending)
        self.bad_steps: list[int] = []
        self.rollbacks: list[tuple[int, str]] = []  # (step, checkpoint restored)
        self._loss: Optional[torch.Tensor] = None

    # ---- detection --------------------------------------------------------------------------

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # fp16: the loss scaler owns overflowing gradients (it skips those steps itself)
        grads = [] if scaler is not None else [p.grad for p in params]
        device = trainer.strategy.root_device
        flag = nonfinite_flag(self._loss, grads, device=device)
        self._loss = None
        step = trainer.global_step
        if self.policy == "skip" and scaler is None:
            if bool(flag.item()):  # a host decision: the step must not run
                for p in params:
                    p.grad = None
                self._report(trainer, pl_module, step, "the optimizer step is skipped")
            return
        self.queue.push(step, flag)
        self._handle(trainer, pl_module, self.queue.ready())

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._handle(trainer, pl_module, self.queue.ready())

    @override
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        for step, bad in self.queue.drain():
            if bad:
                if self.policy in ("stop", "rollback"):
                    self.bad_steps.append(step)
                    raise NonFiniteError(
                        f"non-finite loss or gradients at global step {step}, found while saving a checkpoint: "
                        f"the weights being saved may be corrupt, so training stops. {self._resume_hint(trainer)}",
                        step,
                    )
                self._report(trainer, pl_module, step, "logged only (policy 'log')")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._handle(trainer, pl_module, self.queue.drain())

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"bad_steps": list(self.bad_steps)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.bad_steps = list(state_dict.get("bad_steps", []))

    # ---- policies ---------------------------------------------------------------------------

    def _handle(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", flags: list[tuple[int, bool]]) -> None:
        bad = [step for step, is_bad in flags if is_bad]
        if not bad:
            return
        step = bad[0]
        if self.policy == "stop":
            self.bad_steps.extend(bad)
            raise NonFiniteError(
                f"non-finite loss or gradients at global step {step} (policy 'stop'). {self._resume_hint(trainer)}",
                step,
            )
        if self.policy == "rollback":
            stop = self._too_many_rollbacks(trainer, step)
            if stop is not None:
                self.bad_steps.extend(bad)
                raise stop
            self._report(trainer, pl_module, step, "rolling back to the last checkpoint")
            self.bad_steps.extend(bad[1:])
            self._rollback(trainer, pl_module, step)
            self.queue.drain()  # flags of steps taken from the bad weights are moot now
            return
        for s in bad:
            self._report(trainer, pl_module, s, "logged only (policy 'log')")

    def _report(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int, action: str) -> None:
        self.bad_steps.append(step)
        rank_zero_warn(f"non-finite loss or gradients at global step {step}: {action}")
        for logger in trainer.loggers:
            logger.log_metrics({"numerics/nonfinite_step": float(step)}, step=trainer.global_step)

    def _last_checkpoint(self, trainer: "pl.Trainer") -> Optional[str]:
        if self.checkpoint is not None:
            return str(self.checkpoint)
        cb = trainer.checkpoint_callback
        if cb is None:
            return None
        saved = getattr(cb, "_last_checkpoint_saved", "") or getattr(cb, "last_model_path", "")
        return saved or getattr(cb, "best_model_path", "") or None

    def _resume_hint(self, trainer: "pl.Trainer") -> str:
        path = self._last_checkpoint(trainer)
        if path is None:
            return "No checkpoint was saved; lower the learning rate or check the data, then start again."
        return (
            f"The last checkpoint is {path}: resume with trainer.fit(model, data, ckpt_path={path!r}) "
            "(lower the learning rate or skip the offending data first)."
        )

    def _too_many_rollbacks(self, trainer: "pl.Trainer", step: int) -> Optional[NonFiniteError]:
        """The error that stops training instead of another rollback, once ``max_rollbacks`` are spent."""
        done = len(self.rollbacks)
        if self.max_rollbacks is None or done < self.max_rollbacks:
            return None
        earlier = f"; at global steps {', '.join(str(s) for s, _ in self.rollbacks)}" if self.rollbacks else ""
        return NonFiniteError(
            f"non-finite loss or gradients at global step {step} after {done} rollback{'' if done == 1 else 's'} "
            f"(max_rollbacks={self.max_rollbacks}{earlier}): training stops instead of rolling back again. Lower "
            f"the learning rate or skip the offending data, or raise max_rollbacks. {self._resume_hint(trainer)}",
            step,
        )

    def _rollback(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int) -> None:
        path = self._last_checkpoint(trainer)
        if path is None:
            raise NonFiniteError(
                f"non-finite loss or gradients at global step {step} and no checkpoint to roll back to "
                "(add a ModelCheckpoint that saves every N steps, or pass checkpoint=). Training stops.",
                step,
            )
        strategy = trainer.strategy
        ckpt = strategy.load_checkpoint(path)
        # our sharded strategies load model and optimizer in load_checkpoint (these two are no-ops there)
        strategy.load_model_state_dict(ckpt, strict=pl_module.strict_loading)
        strategy.load_optimizer_state_dict(ckpt)
        key = type(trainer.precision_plugin).__qualname__
        if key in ckpt:
            trainer.precision_plugin.load_state_dict(ckpt[key])
        for p in pl_module.parameters():
            p.grad = None  # the step under way (if any) becomes a no-op
        flag = nonfinite_flag(None, [p.detach() for p in pl_module.parameters()], device=strategy.root_device)
        if bool(flag.item()):
            raise NonFiniteError(
                f"rolled back at global step {step} to {path}, but that checkpoint holds non-finite weights: "
                "resume from an earlier checkpoint with trainer.fit(..., ckpt_path=<path>).",
                step,
            )
        self.rollbacks.append((step, str(path)))
