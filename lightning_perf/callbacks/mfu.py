"""MFUMonitor: tokens/s, samples/s, TFLOP/s per GPU, MFU and HFU, without per-step syncs."""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_perf.callbacks._utils import batch_size_of, device_of, layout_of, log_scalars
from lightning_perf.perf.flops import count_flops
from lightning_perf.perf.peaks import DTYPES, compute_dtype_name, device_peak
from lightning_perf.perf.throughput import (
    ParallelLayout,
    StepClock,
    Throughput,
    compute_throughput,
    measure_matmul_ceiling,
)

__all__ = ["MFUMonitor"]

_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MFUMonitor(Callback):
    """Throughput and model FLOPs utilisation of every training batch, shown in the progress bar.

    FLOPs per token come from ``flops_per_token=`` if given, else the LightningModule's
    ``flops_per_token(seq_len)`` method, else one count of the forward on the first batch
    (``OpCounter``: ``FlopCounterMode``'s formulas with causal attention counted once;
    model FLOPs = 3 x forward, so recomputation is never counted). When the module (or its
    ``config``) also has ``flops_per_token_full_attention``, ``perf/mfu_full_attention`` gives
    the figure with attention counted over the full square, for comparison. HFU is reported when the
    module has ``hardware_flops_per_token(seq_len)`` or with ``count_backward=True``, which
    also counts one backward (recomputation included).

    Step time is the interval between consecutive batch ends: CUDA events read with
    ``query()`` once complete (a step or more later), the host clock on CPU. The layout
    comes from the trainer: tokens count once per data-parallel replica, FLOPs divide over
    all GPUs. The peak is the table's dense peak for the device and the precision's
    compute dtype, or ``peak_flops=``; it is logged once at the start.

    Args:
        peak_flops: FLOP/s per device to compute MFU against (needed on CPU).
        dtype: compute dtype for the table lookup (``fp32``/``tf32``/``bf16``/``fp16``/``fp8``);
            default from ``Trainer(precision=...)``.
        flops_per_token: model FLOPs per token (forward + backward), overriding the module.
        measure_ceiling: time a large matmul at fit start and also report MFU against it; on a device
            with no known peak (a CPU) and no ``peak_flops=``, MFU is then computed against it.
        count_backward: with the FLOP-counter fallback, also count one backward for HFU.
        window: steps per reported value (logged once per window, which keeps the
            per-step host cost to recording one event).
        warmup_steps: first step intervals ignored (compilation, allocator warm-up).
        prog_bar: show tokens/s and MFU in the progress bar.
    """

    def __init__(
        self,
        *,
        peak_flops: Optional[float] = None,
        dtype: Optional[str] = None,
        flops_per_token: Optional[float] = None,
        measure_ceiling: bool = False,
        count_backward: bool = False,
        window: int = 10,
        warmup_steps: int = 2,
        prog_bar: bool = True,
    ) -> None:
        super().__init__()
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if flops_per_token is not None and flops_per_token <= 0:
            raise ValueError(f"flops_per_token must be > 0, got {flops_per_token}")
        if window < 1 or warmup_steps < 0:
            raise ValueError(f"window ({window}) must be >= 1 and warmup_steps ({warmup_steps}) >= 0")
        self.peak_flops_override = peak_flops
        self.dtype = dtype
        self.flops_per_token_override = flops_per_token
        self.measure_ceiling = measure_ceiling
        self.count_backward = count_backward
        self.window = window
        self.warmup_steps = warmup_steps
        self.prog_bar = prog_bar
        # state of one fit
        self.layout: Optional[ParallelLayout] = None
        self.peak_flops: Optional[float] = None
        self.peak_name: Optional[str] = None
        self.ceiling_flops: Optional[float] = None
        self.history: list[Throughput] = []
        self._fpt_cache: dict[Optional[int], tuple[float, Optional[float]]] = {}
        self._full_attention_ratio: Optional[float] = None
        self._clock: Optional[StepClock] = None
        self._recent: deque[tuple[float, tuple[int, int, float, Optional[float]]]] = deque()
        self._window_done: list[tuple[float, tuple[int, int, float, Optional[float]]]] = []
        self._seen = 0
        self._batch: Optional[tuple[int, int, float, Optional[float]]] = None

    # ---- FLOPs per token ------------------------------------------------------------------------

    def _flops_per_token(self, pl_module: LightningModule, batch: Any, batch_idx: int, tokens: int,
                         seq_len: Optional[int]) -> tuple[float, Optional[float]]:
        """``(model, hardware or None)`` FLOPs per token for this sequence length (cached)."""
        if seq_len in self._fpt_cache:
            return self._fpt_cache[seq_len]
        hw_fn = getattr(pl_module, "hardware_flops_per_token", None)
        if self.flops_per_token_override is not None:
            model = float(self.flops_per_token_override)
            hw = float(hw_fn(seq_len)) if callable(hw_fn) else None
        elif callable(getattr(pl_module, "flops_per_token", None)):
            model = float(pl_module.flops_per_token(seq_len))
            hw = float(hw_fn(seq_len)) if callable(hw_fn) else None
        else:
            count = self._count(pl_module, batch, batch_idx)
            model = count.model / max(tokens, 1)
            hw = count.hardware / max(tokens, 1) if count.hardware is not None else None
        self._fpt_cache[seq_len] = (model, hw)
        full_fn = getattr(pl_module, "flops_per_token_full_attention", None)
        if not callable(full_fn):
            full_fn = getattr(getattr(pl_module, "config", None), "flops_per_token_full_attention", None)
        if callable(full_fn) and self.flops_per_token_override is None and model > 0:
            self._full_attention_ratio = float(full_fn(seq_len)) / model
        return model, hw

    def _count(self, pl_module: LightningModule, batch: Any, batch_idx: int) -> Any:
        """Count one ``training_step`` (forward; backward too with ``count_backward``), logging muted."""
        saved_grads = {p: p.grad for p in pl_module.parameters()}
        pl_module.log = lambda *a, **k: None  # type: ignore[method-assign]
        pl_module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            def forward() -> Any:
                with torch.set_grad_enabled(self.count_backward):
                    return pl_module.training_step(batch, batch_idx)

            def backward(out: Any) -> None:
                loss = out["loss"] if isinstance(out, dict) else out
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()

            return count_flops(forward, backward if self.count_backward else None)
        finally:
            del pl_module.log, pl_module.log_dict
            for p, g in saved_grads.items():
                p.grad = g

    # ---- hooks -----------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.layout = layout_of(trainer)
        device = device_of(trainer, pl_module)
        self._clock = StepClock(device)
        self._recent.clear()
        self._seen = 0
        self.history = []
        dtype = self.dtype or compute_dtype_name(getattr(trainer, "precision", None), torch.get_float32_matmul_precision())
        if self.measure_ceiling and dtype in _TORCH_DTYPES:
            self.ceiling_flops = measure_matmul_ceiling(device, _TORCH_DTYPES[dtype])
        if self.peak_flops_override is not None:
            self.peak_flops, self.peak_name = self.peak_flops_override, f"user peak_flops ({dtype})"
        else:
            peak = device_peak(device)
            self.peak_flops = peak.flops_for(dtype) if peak is not None else None
            self.peak_name = f"{peak.name} {dtype}" if peak is not None else None
            if self.peak_flops is None and self.ceiling_flops:
                # no datasheet peak (a CPU, an unlisted GPU): the measured matmul ceiling is the honest reference
                self.peak_flops, self.peak_name = self.ceiling_flops, f"measured matmul ceiling ({dtype})"
            elif self.peak_flops is None:
                name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
                rank_zero_warn(f"MFUMonitor: no {dtype} peak known for {name!r}; pass peak_flops= or "
                               "measure_ceiling=True to get MFU")
        if self.peak_flops is not None:
            ceiling = (f", measured matmul ceiling {self.ceiling_flops / 1e12:.4g} TFLOP/s"
                       if self.ceiling_flops and self.ceiling_flops != self.peak_flops else "")
            rank_zero_info(f"MFUMonitor: peak {self.peak_flops / 1e12:.4g} TFLOP/s per device "
                           f"({self.peak_name}){ceiling}; layout world={self.layout.world_size} "
                           f"dp={self.layout.data_parallel_size}")
            for logger in trainer.loggers:
                logger.log_metrics({"perf/peak_tflops": self.peak_flops / 1e12}, step=trainer.global_step)
        self._clock.mark(None)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        samples, tokens, seq_len = batch_size_of(batch)
        model, hw = self._flops_per_token(pl_module, batch, batch_idx, tokens, seq_len)
        self._batch = (samples, tokens, model, hw)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._clock is None or self._batch is None:
            return
        self._clock.mark(self._batch)
        updated = False
        for seconds, payload in self._clock.poll():
            self._seen += 1
            if self._seen <= self.warmup_steps or payload is None or seconds <= 0:
                continue
            self._recent.append((seconds, payload))
            if len(self._recent) == self.window:  # a full window: report it, start the next
                self._window_done = list(self._recent)
                self._recent.clear()
                updated = True
        if updated:
            result = self._compute()
            self.history.append(result)
            values = {
                "perf/tokens_per_sec": result.tokens_per_sec,
                "perf/samples_per_sec": result.samples_per_sec,
                "perf/tflops_per_gpu": result.tflops_per_gpu,
                "perf/step_time_ms": result.step_time_s * 1e3,
            }
            for key in ("mfu", "hfu", "mfu_ceiling"):
                value = getattr(result, key)
                if value is not None:
                    values[f"perf/{key}"] = value
            if result.mfu is not None and self._full_attention_ratio is not None:
                # attention counted over the full square (the other common convention), to compare
                values["perf/mfu_full_attention"] = result.mfu * self._full_attention_ratio
            log_scalars(pl_module, values, prog_bar=("perf/tokens_per_sec", "perf/mfu") if self.prog_bar else ())

    def _compute(self) -> Throughput:
        """Window average: total tokens and FLOPs over total time."""
        assert self.layout is not None
        rows = self._window_done
        seconds = sum(s for s, _ in rows)
        samples = sum(p[0] for _, p in rows)
        tokens = sum(p[1] for _, p in rows)
        flops = sum(p[1] * p[2] for _, p in rows)
        hw = None if any(p[3] is None for _, p in rows) else sum(p[1] * p[3] for _, p in rows)
        n = len(rows)
        return compute_throughput(
            step_time_s=seconds / n,
            local_tokens=tokens // n if tokens % n == 0 else tokens / n,  # type: ignore[arg-type]
            local_samples=samples / n,  # type: ignore[arg-type]
            layout=self.layout,
            flops_per_token=flops / tokens if tokens else 0.0,
            peak_flops=self.peak_flops,
            hardware_flops_per_token=(hw / tokens if tokens else None) if hw is not None else None,
            ceiling_flops=self.ceiling_flops,
        )

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is not None:
            self._clock.reset()

    def summary(self) -> dict[str, Any]:
        """The median window's figures (robust to steps other callbacks profiled) and the peak used."""
        ranked = sorted(self.history, key=lambda t: t.step_time_s)
        mid = ranked[len(ranked) // 2].as_dict() if ranked else {}
        out = {**mid, "windows": len(ranked), "peak_flops": self.peak_flops, "peak": self.peak_name,
               "ceiling_flops": self.ceiling_flops}
        if mid.get("mfu") is not None and self._full_attention_ratio is not None:
            out["mfu_full_attention"] = mid["mfu"] * self._full_attention_ratio
        return out
