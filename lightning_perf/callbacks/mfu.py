"""MFUMonitor: tokens/s, samples/s, TFLOP/s per device, MFU and HFU over the measured window, without per-step syncs."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, NamedTuple, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_perf.callbacks._utils import batch_size_of, device_of, doc_ids_of, layout_of, log_scalars, sampled_steps_of
from lightning_perf.perf.documents import DocumentWorkReader, packed_batch_flops
from lightning_perf.perf.flops import count_flops
from lightning_perf.perf.peaks import DTYPES, compute_dtype_name, device_peak
from lightning_perf.perf.steps import StepLedger, StepRow, StepTimer, StepWindow
from lightning_perf.perf.throughput import (
    ParallelLayout,
    Throughput,
    device_unit,
    measure_matmul_ceiling,
    over_reference,
    window_throughput,
)

__all__ = ["MFUMonitor"]

_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_REMEASURES = 2  # times a measured ceiling is timed again when a window beats it, before it is declared unreliable


class _PerToken(NamedTuple):
    """FLOPs per token of one causal sequence: model, hardware (None: not known), and their attention
    parts (None: not known, so a packed batch cannot be counted per document)."""

    model: float
    hardware: Optional[float]
    attention: Optional[float]
    hardware_attention: Optional[float]


class MFUMonitor(Callback):
    """Throughput and model FLOPs utilisation of the training run, shown in the progress bar.

    Every figure is over one stated window, the same one ``PerfReport`` prints: the mean over the
    measured steps so far, where a step is the wall time from one batch start to the next (data
    waits, hooks and logging included; the last step of the fit ends at its batch end), the first
    ``warmup_steps`` are left out, and so are the steps a diagnostic callback sampled (its
    ``sampled_steps``: profiled, FLOP-counted or ceiling re-measured steps). Rates are totals over
    total time: ``tokens/s = tokens per step / mean step time`` and
    ``MFU = model FLOPs of the window / its wall time / devices / peak``. Every ``window`` measured
    steps it logs the run's figures (``perf/tokens_per_sec`` when batches are token ids, else
    ``perf/samples_per_sec``; ``perf/tflops_per_gpu``, or ``perf/tflops_per_process`` off a GPU;
    ``perf/step_time_ms``, ``perf/mfu``, ``perf/hfu``, ``perf/mfu_ceiling``) and the last ``window``
    steps' ``perf/step_time_ms_window`` and ``perf/mfu_window``; at the end of training the final
    run figures go to the loggers.

    FLOPs per token come from ``flops_per_token=`` if given, else the LightningModule's
    ``flops_per_token(seq_len)`` method, else one count of the forward on the first batch
    (``OpCounter``: ``FlopCounterMode``'s formulas with causal attention counted once;
    model FLOPs = 3 x forward, so recomputation is never counted). When the module (or its
    ``config``) also has ``flops_per_token_full_attention``, ``perf/mfu_full_attention`` gives
    the figure with attention counted over the full square, for comparison. HFU is reported when the
    module has ``hardware_flops_per_token(seq_len)`` or with ``count_backward=True``, which
    also counts one backward (recomputation included).

    Packed batches (``(inputs, targets, doc_ids)`` or a dict with ``"doc_ids"``, as
    ``TokenDataModule(pack_documents=True)`` makes them) have their attention counted per document:
    each document of length L as one causal sequence of L tokens, so a row does
    ``A(T) / T * sum L**2`` attention FLOPs in place of ``T * A(T)``
    (``lightning_perf.perf.documents``). ``A(T)`` is the module's (or its ``config``'s)
    ``attention_flops_per_token(seq_len)`` (and ``hardware_attention_flops_per_token`` for HFU), or
    the attention ops of the FLOP count. The sum is computed where the batch lives and read once the
    step has completed, through pinned memory: no sync. The run logs ``perf/mean_document_tokens``,
    says "attention counted per document" once, and ``summary()["attention"]`` states it; a module
    that gives ``flops_per_token`` but not its attention part (or ``flops_per_token=``) keeps the
    whole-row count, with a warning.

    Steps are timed with CUDA events read with ``query()`` once complete (a step or more later),
    the host clock on CPU. The layout comes from the trainer: tokens count once per data-parallel
    replica, FLOPs divide over all devices (GPUs; processes on a CPU). The peak is the table's dense
    peak for the device and the precision's compute dtype, or ``peak_flops=``; it is logged once at
    the start. A utilisation above 100% is never logged as a value: a window that beats the
    measured matmul ceiling has the ceiling timed again (best of five, up to twice per fit); if it
    still beats it the ceiling is declared unreliable, and MFU against it is logged as NaN and
    reported as "n/a" with the reason (``mfu_note``). Against a datasheet or user peak the same
    holds: above 100% means the FLOP count or the peak is wrong.

    Args:
        peak_flops: FLOP/s per device to compute MFU against (needed on CPU).
        dtype: compute dtype for the table lookup (``fp32``/``tf32``/``bf16``/``fp16``/``fp8``);
            default from ``Trainer(precision=...)``.
        flops_per_token: model FLOPs per token (forward + backward), overriding the module.
        measure_ceiling: time a large matmul at fit start and also report MFU against it; on a device
            with no known peak (a CPU) and no ``peak_flops=``, MFU is then computed against it.
        count_backward: with the FLOP-counter fallback, also count one backward for HFU.
        window: measured steps between two logged values (and the span of the ``*_window`` figures).
        warmup_steps: first steps left out (compilation, allocator warm-up).
        prog_bar: show tokens/s (samples/s) and MFU in the progress bar.
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
        self.unit = "GPU"  # what per-device figures are per: "GPU", or "process" off a GPU
        self.peak_flops: Optional[float] = None
        self.peak_name: Optional[str] = None
        self.ceiling_flops: Optional[float] = None
        self.ceiling_note: Optional[str] = None  # set when the measured ceiling proved unreliable
        self.ceiling_measurements = 0
        self.ledger = StepLedger()
        self.sampled_steps: list[int] = []  # steps in which this callback counted FLOPs or re-timed the ceiling
        self.excluded: set[int] = set()  # every diagnostic's sampled steps, as of the last figures
        self.history: list[Throughput] = []  # the run's figures at each log
        self._peak_is_ceiling = False
        self._torch_dtype: Optional[torch.dtype] = None
        self._device = torch.device("cpu")
        self._fpt_cache: dict[tuple[Optional[int], bool], _PerToken] = {}
        self._full_attention_ratio: Optional[float] = None
        self._full_attention_extra: Optional[float] = None  # (full-square - causal) attention FLOPs per causal one
        self._documents = DocumentWorkReader()
        self.packed_steps = 0  # recorded steps whose batch carried doc_ids, attention counted per document
        self.packed_tokens = 0
        self.documents = 0
        self.attention_note: Optional[str] = None  # how attention was counted when batches are packed
        self._timer: Optional[StepTimer] = None
        self._new_measured = 0
        self._counted = False
        self._warned: set[str] = set()

    # ---- FLOPs per token ------------------------------------------------------------------------

    def _flops_per_token(self, pl_module: LightningModule, batch: Any, batch_idx: int, tokens: int,
                         seq_len: Optional[int], packed: bool) -> _PerToken:
        """FLOPs per token of one causal sequence of this length, and their attention parts (cached)."""
        key = (seq_len, packed)
        if key in self._fpt_cache:
            return self._fpt_cache[key]
        hw_fn = getattr(pl_module, "hardware_flops_per_token", None)
        attention = hw_attention = None
        if self.flops_per_token_override is not None:
            model = float(self.flops_per_token_override)
            hw = float(hw_fn(seq_len)) if callable(hw_fn) else None
        elif callable(getattr(pl_module, "flops_per_token", None)):
            model = float(pl_module.flops_per_token(seq_len))
            hw = float(hw_fn(seq_len)) if callable(hw_fn) else None
            attn_fn = _method(pl_module, "attention_flops_per_token")
            if attn_fn is not None:
                attention = float(attn_fn(seq_len))
                hw_attn_fn = _method(pl_module, "hardware_attention_flops_per_token")
                hw_attention = float(hw_attn_fn(seq_len)) if hw_attn_fn is not None and hw is not None else attention
        else:
            count = self._count(pl_module, batch, batch_idx)
            self._counted = True
            n = max(tokens, 1)
            model = count.model / n
            hw = count.hardware / n if count.hardware is not None else None
            counted = count.by_category.get("attention", 0)
            # a document-masked attention op is counted over the full square; its causal count is half of it
            causal = count.causal_attention_forward + (counted - count.causal_attention_forward) / 2 if packed else counted
            attention = hw_attention = 3 * causal / n
            model -= 3 * (counted - causal) / n
            hw = None if hw is None else hw - 3 * (counted - causal) / n
        per_token = self._fpt_cache[key] = _PerToken(model, hw, attention, hw_attention)
        full_fn = _method(pl_module, "flops_per_token_full_attention")
        if full_fn is not None and self.flops_per_token_override is None and model > 0:
            full = float(full_fn(seq_len))
            self._full_attention_ratio = full / model
            self._full_attention_extra = (full - model) / attention if attention else None
        return per_token

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
        self.packed_steps, self.packed_tokens, self.documents, self.attention_note = 0, 0, 0, None
        self.layout = layout_of(trainer)
        device = device_of(trainer, pl_module)
        self._device, self.unit = device, device_unit(device)
        self._timer = StepTimer(device)
        self.ledger.clear()
        self.history, self.sampled_steps, self.excluded = [], [], set()
        self._new_measured = 0
        self.ceiling_flops, self.ceiling_note, self.ceiling_measurements = None, None, 0
        self._peak_is_ceiling = False
        dtype = self.dtype or compute_dtype_name(getattr(trainer, "precision", None), torch.get_float32_matmul_precision())
        self._torch_dtype = _TORCH_DTYPES.get(dtype)
        if self.measure_ceiling and self._torch_dtype is not None:
            self.ceiling_flops = measure_matmul_ceiling(device, self._torch_dtype)
            self.ceiling_measurements = 1
        if self.peak_flops_override is not None:
            self.peak_flops, self.peak_name = self.peak_flops_override, f"user peak_flops ({dtype})"
        else:
            peak = device_peak(device)
            self.peak_flops = peak.flops_for(dtype) if peak is not None else None
            self.peak_name = f"{peak.name} {dtype}" if peak is not None else None
            if self.peak_flops is None and self.ceiling_flops:
                # no datasheet peak (a CPU, an unlisted GPU): the measured matmul ceiling is the honest reference
                self.peak_flops, self.peak_name = self.ceiling_flops, f"measured matmul ceiling ({dtype})"
                self._peak_is_ceiling = True
            elif self.peak_flops is None:
                name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
                rank_zero_warn(f"MFUMonitor: no {dtype} peak known for {name!r}; pass peak_flops= or "
                               "measure_ceiling=True to get MFU")
        if self.peak_flops is not None:
            ceiling = (f", measured matmul ceiling {self.ceiling_flops / 1e12:.4g} TFLOP/s"
                       if self.ceiling_flops and not self._peak_is_ceiling else "")
            rank_zero_info(f"MFUMonitor: peak {self.peak_flops / 1e12:.4g} TFLOP/s per {self.unit} "
                           f"({self.peak_name}){ceiling}; layout world={self.layout.world_size} "
                           f"dp={self.layout.data_parallel_size}")
            for logger in trainer.loggers:
                logger.log_metrics({"perf/peak_tflops": self.peak_flops / 1e12}, step=trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._timer is None:
            return
        samples, count, seq_len = batch_size_of(batch)
        doc_ids = doc_ids_of(batch) if seq_len is not None else None
        self._counted = False
        fpt = self._flops_per_token(pl_module, batch, batch_idx, count, seq_len, doc_ids is not None)
        if self._counted:
            # the count ran an extra forward between two steps; a callback that stamps its batch start before
            # this one sees it in the next step, one that stamps after in the previous: both leave the window
            self.sampled_steps += [i for i in (self._timer.index, self._timer.index + 1) if i >= 0]
        documents = None
        if doc_ids is not None and fpt.attention is not None:
            # queued on the device before the step's closing event: complete, hence readable, when the step resolves
            documents = (self._documents.issue(doc_ids), seq_len)
        elif doc_ids is not None:
            self._note_attention("counted over whole rows: packed batches (doc_ids) but the module gives "
                                 "flops_per_token without its attention part (attention_flops_per_token) or "
                                 "flops_per_token= was passed", warn=True)
        attention = None if fpt.attention is None else fpt.attention * count
        row = (samples, count if seq_len is not None else None, fpt.model * count,
               None if fpt.hardware is None else fpt.hardware * count, attention, fpt, documents)
        self._timer.start(row)

    def _note_attention(self, note: str, *, warn: bool = False) -> None:
        if self.attention_note is None:
            self.attention_note = note
            (rank_zero_warn if warn else rank_zero_info)(f"MFUMonitor: attention {note}")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._timer is None:
            return
        self._timer.end()
        self._record(self._timer.poll(), trainer)
        if self._new_measured >= self.window:
            self._new_measured = 0
            values = self._figures_to_log(trainer, inside_step=True)
            if values:
                shown = ("perf/tokens_per_sec" if "perf/tokens_per_sec" in values else "perf/samples_per_sec",
                         "perf/mfu")
                log_scalars(pl_module, values, prog_bar=shown if self.prog_bar else ())

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timer is None:
            return
        self._record(self._timer.finish(), trainer)
        values = self._figures_to_log(trainer, inside_step=False)
        if values:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        self._timer = None

    def _record(self, records: list[Any], trainer: Trainer) -> None:
        skip = sampled_steps_of(trainer)
        for r in records:
            samples, tokens, flops, hw, attention, fpt, documents = r.payload
            if documents is not None:
                handle, seq_len = documents
                work = self._documents.read(handle)
                attention = fpt.attention / seq_len * work.square_sum
                flops = packed_batch_flops(tokens=tokens, seq_len=seq_len, flops_per_token=fpt.model,
                                           attention_flops_per_token=fpt.attention, square_sum=work.square_sum)
                if fpt.hardware is not None:
                    hw = packed_batch_flops(tokens=tokens, seq_len=seq_len, flops_per_token=fpt.hardware,
                                            attention_flops_per_token=fpt.hardware_attention,
                                            square_sum=work.square_sum)
                self.packed_steps += 1
                self.packed_tokens += tokens
                self.documents += work.documents
                self._note_attention("counted per document (packed batches: each document as one causal "
                                     "sequence of its length)")
            self.ledger.add(StepRow(index=r.index, seconds=r.seconds, samples=samples, tokens=tokens, flops=flops,
                                    hardware_flops=hw, attention_flops=attention))
            if r.index >= self.warmup_steps and r.index not in skip:
                self._new_measured += 1

    def _full_attention_factor(self, window: StepWindow) -> Optional[float]:
        """Model FLOPs with attention over the full square, per model FLOP counted, over the window."""
        if self.packed_steps and self._full_attention_extra is not None:
            if window.flops and window.attention_flops is not None:
                return (window.flops + self._full_attention_extra * window.attention_flops) / window.flops
            return None
        return self._full_attention_ratio

    @property
    def mean_document_tokens(self) -> Optional[float]:
        """Tokens per document over the packed batches recorded so far (None: no packed batch)."""
        return self.packed_tokens / self.documents if self.documents else None

    # ---- figures -----------------------------------------------------------------------------------

    def run_window(self, *, warmup: Optional[int] = None, exclude: Optional[set[int]] = None,
                   spread: bool = False) -> StepWindow:
        """The measured window of this fit (by default: after ``warmup_steps``, less every sampled step);
        ``spread`` adds the median and p90 step."""
        return self.ledger.window(warmup=self.warmup_steps if warmup is None else warmup,
                                  exclude=self.excluded if exclude is None else exclude, spread=spread)

    def figures(self, window: StepWindow) -> tuple[Throughput, Optional[str]]:
        """The window's throughput with every utilisation above 100% (or against an unreliable
        ceiling) set to ``None``, and the reason MFU is missing when it is."""
        assert self.layout is not None
        t = window_throughput(window, layout=self.layout, peak_flops=self.peak_flops,
                              ceiling_flops=self.ceiling_flops)
        note = None
        ceiling_bad = self.ceiling_note is not None or over_reference(t.mfu_ceiling)
        if ceiling_bad:
            ceiling_note = self.ceiling_note or self._ceiling_note(t)
            t = replace(t, mfu_ceiling=None)
            if self._peak_is_ceiling:
                t, note = replace(t, mfu=None, hfu=None), ceiling_note
        if over_reference(t.mfu):
            note = (f"over 100% of the peak ({t.tflops_per_device:.4g} TFLOP/s per {self.unit} achieved, "
                    f"{self.peak_name} {self.peak_flops / 1e12:.4g}): the FLOP count (flops_per_token) or "
                    "the peak is wrong")
            t = replace(t, mfu=None)
        if over_reference(t.hfu):
            t = replace(t, hfu=None)
        return t, note

    def _ceiling_note(self, t: Throughput) -> str:
        assert self.ceiling_flops is not None
        return (f"ceiling unreliable: {t.tflops_per_device:.4g} TFLOP/s achieved per {self.unit} is above the "
                f"measured matmul ceiling of {self.ceiling_flops / 1e12:.4g} TFLOP/s (timed "
                f"{self.ceiling_measurements} times, best of five each; a busy host times it low); "
                "pass peak_flops=")

    def _settle_ceiling(self, windows: list[StepWindow], *, inside_step: bool) -> None:
        """Time the ceiling again while a window beats it; declare it unreliable after ``_REMEASURES``."""
        assert self.layout is not None
        windows = [w for w in windows if w.steps and w.seconds > 0]
        while self.ceiling_flops and self.ceiling_note is None and self._torch_dtype is not None:
            raw = [window_throughput(w, layout=self.layout, ceiling_flops=self.ceiling_flops) for w in windows]
            beaten = [t for t in raw if over_reference(t.mfu_ceiling)]
            if not beaten:
                return
            if self.ceiling_measurements > _REMEASURES:
                self.ceiling_note = self._ceiling_note(max(beaten, key=lambda t: t.tflops_per_device or 0.0))
                return
            if inside_step and self._timer is not None:
                self.sampled_steps.append(self._timer.index)  # the timing runs inside the current step
            self.ceiling_flops = max(self.ceiling_flops, measure_matmul_ceiling(self._device, self._torch_dtype))
            self.ceiling_measurements += 1
            if self._peak_is_ceiling:
                self.peak_flops = self.ceiling_flops

    def _figures_to_log(self, trainer: Trainer, *, inside_step: bool) -> dict[str, float]:
        self.excluded = sampled_steps_of(trainer)
        run = self.run_window()
        if not run.steps or run.seconds <= 0:
            return {}
        recent = self.ledger.window(warmup=self.warmup_steps, exclude=self.excluded, last=self.window)
        self._settle_ceiling([run, recent], inside_step=inside_step)
        self.excluded = sampled_steps_of(trainer)
        run = self.run_window()
        recent = self.ledger.window(warmup=self.warmup_steps, exclude=self.excluded, last=self.window)
        if not run.steps or run.seconds <= 0 or recent.seconds <= 0:
            return {}
        result, note = self.figures(run)
        last, _ = self.figures(recent)
        self.history.append(result)
        if note is not None and note not in self._warned:
            self._warned.add(note)
            rank_zero_warn(f"MFUMonitor: MFU n/a, {note}")
        values: dict[str, float] = {"perf/samples_per_sec": result.samples_per_sec,
                                    "perf/step_time_ms": result.step_time_s * 1e3,
                                    "perf/step_time_ms_window": last.step_time_s * 1e3}
        if result.tokens_per_sec is not None:
            values["perf/tokens_per_sec"] = result.tokens_per_sec
        if result.tflops_per_device is not None:
            values[f"perf/tflops_per_{self.unit.lower()}"] = result.tflops_per_device
        if self.peak_flops is not None and result.tflops_per_device is not None:
            # NaN, not a number above 100%, when the reference proved wrong (the reason is warned once)
            values["perf/mfu"] = result.mfu if result.mfu is not None else math.nan
            values["perf/mfu_window"] = last.mfu if last.mfu is not None else math.nan
        for key in ("hfu", "mfu_ceiling"):
            value = getattr(result, key)
            if value is not None:
                values[f"perf/{key}"] = value
        factor = self._full_attention_factor(run)
        if result.mfu is not None and factor is not None:
            # attention counted over the full square (the other common convention), to compare
            values["perf/mfu_full_attention"] = result.mfu * factor
        if self.mean_document_tokens is not None:
            values["perf/mean_document_tokens"] = self.mean_document_tokens
        return values

    @property
    def mfu_note(self) -> Optional[str]:
        """Why the run's MFU is n/a (``None`` when it is a value, or when there is no peak)."""
        run = self.run_window()
        return self.figures(run)[1] if run.steps and run.seconds > 0 and self.layout is not None else None

    def summary(self) -> dict[str, Any]:
        """The run's figures over its measured window (the window stated under ``"window"``) and the peak used."""
        run = self.run_window()
        out: dict[str, Any] = {"window": run.describe(), "steps": run.steps, "peak_flops": self.peak_flops,
                               "peak": self.peak_name, "ceiling_flops": self.ceiling_flops,
                               "ceiling_note": self.ceiling_note, "unit": self.unit, "mfu_note": None,
                               "attention": self.attention_note, "mean_document_tokens": self.mean_document_tokens}
        if run.steps and run.seconds > 0 and self.layout is not None:
            result, out["mfu_note"] = self.figures(run)
            out.update(result.as_dict())
            factor = self._full_attention_factor(run)
            if result.mfu is not None and factor is not None:
                out["mfu_full_attention"] = result.mfu * factor
        return out


def _method(pl_module: LightningModule, name: str) -> Any:
    """``pl_module.<name>``, else ``pl_module.config.<name>``, if callable; else None."""
    fn = getattr(pl_module, name, None)
    if not callable(fn):
        fn = getattr(getattr(pl_module, "config", None), name, None)
    return fn if callable(fn) else None
