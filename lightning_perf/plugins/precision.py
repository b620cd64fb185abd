"""``PerfPrecision``: one precision plugin for every strategy of the pack.

=============  ===============================  =========================  ==============
precision      FSDP2 (ZeRO-2/3, 3D)              DDP path (ZeRO-1)          loss scaling
=============  ===============================  =========================  ==============
32-true        fp32 everywhere                   fp32                       no
bf16-mixed     params bf16, reduce fp32          autocast bf16              no
16-mixed       params fp16, reduce fp32          autocast fp16              dynamic
bf16-true      module cast to bf16               module cast to bf16        no
=============  ===============================  =========================  ==============

Master weights and optimizer state stay fp32 in the mixed modes (FSDP2 keeps the sharded
fp32 parameters and casts the all-gathered copy; autocast casts per op). fp16 dynamic
loss scaling uses :class:`~lightning_perf.parallel.sharding.loss_scaler.DistributedLossScaler`, whose
inf/NaN flag is all-reduced over the whole world (every rank of every mesh dimension),
so every rank skips the same steps. The scale and the skipped-step count are logged as
``precision/loss_scale`` and ``precision/skipped_steps`` and saved in checkpoints.

A pipeline schedule that computes the loss itself calls :meth:`PerfPrecision.scale_loss`
inside its loss function and leaves unscaling, the overflow check, the skip and the
scale update to :meth:`PerfPrecision.optimizer_step`.

Gradient clipping by norm meets a fused ``torch.optim.Adam``/``AdamW`` inside the step: the
Trainer's ``gradient_clip_val`` computes the global norm as ``clip_grad_norm_`` does, and hands the
clip factor to the fused kernel as its gradient divisor (the ``grad_scale`` that the kernel already
reads for AMP), so the gradients are not rewritten by a separate pass over them before the step
reads them again. The update is that of clip-then-step (to fp32 rounding). This applies under
automatic optimization with no fp16 loss scaler, when the gradients are plain tensors on one device
(one device, DDP) or FSDP2's DTensor shards of one mesh (ZeRO-2/3, HSDP); otherwise (tensor or
pipeline parallel, whose strategy clips itself, or a loss scaler) they are clipped in place.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.fabric.utilities.types import Steppable
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning_perf.parallel.sharding.loss_scaler import DistributedLossScaler

__all__ = ["PerfPrecision", "PRECISIONS", "normalize_precision"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
_DTYPES = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


def normalize_precision(precision: Any) -> Any:
    """Lightning's short spellings (``"bf16"``, ``16``, ``"32"``, ...) as the names in :data:`PRECISIONS`."""
    return _ALIASES.get(precision, precision)


def _fused_adam(optimizer: Any) -> bool:
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
            and all(group.get("fused") for group in optimizer.param_groups))


def fold_clip_into_fused_step(optimizer: Any, max_norm: float) -> bool:
    """Clip by the global L2 norm inside the next step of a fused Adam/AdamW; False when it cannot.

    The norm and the factor are those of ``torch.nn.utils.clip_grad_norm_(params, max_norm)``
    (``min(1, max_norm / (norm + 1e-6))``); the factor's reciprocal becomes the optimizer's
    ``grad_scale``, which torch's fused kernel divides each gradient by as it reads it (and writes
    back, as after clipping). Nothing waits on the device. The caller clears it after the step
    (:func:`clear_folded_clip`). Refused (False, nothing changed) unless the optimizer is a fused
    Adam/AdamW with no ``grad_scale``/``found_inf`` of its own, and the gradients are dense, on one
    device, and either all plain tensors (one device, DDP) or all DTensors of one mesh (FSDP2's
    shards, whose norm is then reduced over the mesh as ``clip_grad_norm_`` does: every rank calls
    this together).
    """
    if not _fused_adam(optimizer) or not math.isfinite(max_norm) or max_norm <= 0:
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads or any(g.is_sparse for g in grads):
        return False
    from torch.distributed.tensor import DTensor

    sharded = [isinstance(g, DTensor) for g in grads]
    if any(type(g) is not Tensor and not isinstance(g, DTensor) for g in grads):
        return False  # another tensor subclass: clipped in place
    if any(sharded) and not all(sharded) or len({g.device for g in grads}) != 1:
        return False
    if all(sharded) and len({g.device_mesh for g in grads}) != 1:
        return False
    total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
    if isinstance(total, DTensor):  # FSDP2 shards: the norm over every rank's shards (one all-reduce)
        total = total.full_tensor()
    # clip_grad_norm_ multiplies by clamp(max_norm / (total + 1e-6), max=1); the kernel divides by this
    optimizer.grad_scale = 1.0 / torch.clamp(float(max_norm) / (total.float() + 1e-6), max=1.0)
    _FOLDED_CLIP.add(optimizer)
    return True


def clear_folded_clip(optimizer: Any) -> None:
    """Remove the clip factor that :func:`fold_clip_into_fused_step` left on ``optimizer``."""
    if optimizer in _FOLDED_CLIP:
        optimizer.grad_scale = None
        _FOLDED_CLIP.discard(optimizer)


# optimizers whose grad_scale holds a clip factor of fold_clip_into_fused_step (not a grad scaler's)
_FOLDED_CLIP: "weakref.WeakSet[Any]" = weakref.WeakSet()


class _DefaultDtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *args: Any) -> None:
        torch.set_default_dtype(self.previous)


class PerfPrecision(Precision):
    """Mixed / true precision with world-consistent fp16 loss scaling.

    Args:
        precision: ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"`` or ``"32-true"``.
        init_scale, growth_factor, backoff_factor, growth_interval: fp16 loss scaling
            (ignored by the other modes).
        reduce_dtype: gradient reduction dtype of the FSDP2 policy (fp32 by default).
        device_type: autocast device; by default the device of the model's parameters when the
            strategy connects the model (the pack's strategies set their root device).
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        reduce_dtype: torch.dtype = torch.float32,
        device_type: Optional[str] = None,
    ) -> None:
        precision = normalize_precision(precision)
        if precision not in PRECISIONS:
            raise ValueError(f"PerfPrecision does not support precision={precision!r}; choose one of {PRECISIONS}")
        self.precision = precision  # type: ignore[assignment]
        self.dtype = _DTYPES[precision]
        self.reduce_dtype = reduce_dtype
        self._device_type_given = device_type is not None
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        # set by the strategy: True when FSDP2's MixedPrecisionPolicy casts (no autocast then)
        self.sharded_casting = False
        self.scaler: Optional[DistributedLossScaler] = None
        if precision == "16-mixed":
            self.scaler = DistributedLossScaler(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            )
        self.last_step_skipped = False
        self._folding = False  # True inside an automatic-optimization step (see clip_grad_by_norm)

    @property
    def is_mixed(self) -> bool:
        return self.precision in ("bf16-mixed", "16-mixed")

    @property
    def is_true_half(self) -> bool:
        return self.precision == "bf16-true"

    # ---- for the strategies ----------------------------------------------------------------

    def mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` of this precision (fp32 policy for the true modes)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.is_mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.reduce_dtype)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale`` under fp16, ``loss`` otherwise; for losses computed inside a schedule."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    # ---- Lightning hooks ---------------------------------------------------------------------

    @override
    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        # on Lightning's single-device and DDP strategies the model is on its device by now
        if not self._device_type_given:
            device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
            if device is not None:
                self.device_type = device.type
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.dtype) if self.is_true_half else module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return _DefaultDtype(self.dtype) if self.is_true_half else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed and not self.sharded_casting:
            with torch.autocast(self.device_type, dtype=self.dtype):
                yield
        elif self.is_true_half:
            with _DefaultDtype(self.dtype):
                yield
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if not self.is_true_half:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        def cast(t: Tensor) -> Tensor:
            return t.to(self.dtype) if torch.is_floating_point(t) else t

        return apply_to_collection(data, function=cast, dtype=Tensor)

    @override
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        tensor = self.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            # under automatic optimization the closure clips; the clip may then ride on a fused step
            self._folding = bool(getattr(model, "automatic_optimization", False))
            try:
                return super().optimizer_step(optimizer, model, closure, **kwargs)
            finally:
                self._folding = False
                clear_folded_clip(optimizer)
        closure_result = closure()
        # unscale before the hooks so gradient clipping and inspection see true values
        found_inf = self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        self.last_step_skipped = found_inf
        step_output = None
        if not found_inf:
            step_output = optimizer.step(**kwargs)
        self.scaler.update(found_inf)
        self._log(model)
        return closure_result if step_output is None else step_output

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: Any) -> None:
        if self._folding and fold_clip_into_fused_step(optimizer, float(clip_val)):
            return
        super().clip_grad_by_norm(optimizer, clip_val)

    def _log(self, model: "pl.LightningModule") -> None:
        if self.scaler is None or getattr(model, "_trainer", None) is None:
            return
        if getattr(model, "_current_fx_name", None) != "optimizer_step":
            return
        model.log("precision/loss_scale", float(self.scaler.loss_scale), on_step=True, on_epoch=False)
        model.log("precision/skipped_steps", float(self.scaler.skipped_steps), on_step=True, on_epoch=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])

    def __repr__(self) -> str:
        return f"PerfPrecision({self.precision!r}, scaler={self.scaler!r})"
