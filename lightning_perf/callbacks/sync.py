"""SyncPointWarner: host-device synchronisations on sampled steps, attributed to source lines."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from typing_extensions import override

from lightning_perf.callbacks._utils import StepSampler, device_of
from lightning_perf.perf.sync import (
    DETECTORS,
    SYNC_KINDS,
    SyncPointError,
    SyncRecorder,
    SyncSite,
    SyncWatch,
    detector_plan,
)

__all__ = ["SyncPointWarner", "SyncPointWarning", "SyncPointError"]


class SyncPointWarning(UserWarning):
    """A line of user code synchronised the host with the device."""


class SyncPointWarner(Callback):
    """Find the lines that make the host wait for the device, on sampled steps only.

    A sampled step is watched from the end of the previous batch to the end of its own
    (so the batch fetch and transfer, the step, the optimizer and the loop's bookkeeping
    are all inside). Every site has a kind (``lightning_perf.perf.sync.SYNC_KINDS``):
    ``pageable_h2d``, ``h2d_copy``, ``d2h_copy``, ``scalar``, ``data_dependent``,
    ``synchronize`` or ``cuda_sync``. Detectors:

    * ``"cuda"`` (default on CUDA): ``torch.cuda.set_sync_debug_mode("warn")``, wrappers of
      ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, ``Stream``/``Event.synchronize``
      and ``Tensor.tolist``, and a light dispatch check that records the non-blocking copies
      through pageable memory (which the debug mode does not report) and names the op behind
      each debug-mode report;
    * ``"dispatch"`` (default on CPU): every aten op classified, host tensors standing in for
      device tensors, so a laptop run shows the sites (and their kinds) before the GPU run;
    * ``"both"``: the debug mode and every op classified.

    The dispatch check does not see inside ``torch.compile`` regions (compiled code cached before the
    watched step runs as usual; a new compilation waits for the next step); the debug mode does.

    Each site is attributed to the innermost frame outside torch; a site in Lightning
    (``owner="lightning"``) or in this package (``owner="lightning_perf"``) is the framework's,
    reported separately with the user's calling line. ``mode="warn"`` warns once per user site;
    ``mode="error"`` raises ``SyncPointError`` at the user's line (for CI). Framework sites never
    raise. A step is not watched while another dispatch mode is active (RooflineMonitor's count).

    Args:
        mode: ``"warn"`` or ``"error"``.
        every_n_steps: watch one step every N (0: only ``start_step``).
        start_step: first watched step (0-based batch count of the fit).
        detector: ``"auto"``, ``"dispatch"``, ``"cuda"`` or ``"both"``.
    """

    def __init__(
        self,
        *,
        mode: Literal["warn", "error"] = "warn",
        every_n_steps: int = 100,
        start_step: int = 5,
        detector: Literal["auto", "dispatch", "cuda", "both"] = "auto",
    ) -> None:
        super().__init__()
        if mode not in ("warn", "error"):
            raise ValueError(f"mode must be 'warn' or 'error', got {mode!r}")
        if detector not in DETECTORS:
            raise ValueError(f"detector must be one of {DETECTORS}, got {detector!r}")
        self.mode = mode
        self.sampler = StepSampler(every=every_n_steps, start=start_step)
        self.detector = detector
        self.recorder = SyncRecorder(on_new=self._on_new_site, raise_on_user=mode == "error")
        self.sampled_steps: list[int] = []
        self._active: list[SyncWatch] = []
        self._step = 0
        self._device_type = "cpu"

    def _on_new_site(self, site: SyncSite) -> None:
        if site.framework or self.mode != "warn":
            return
        rank_zero_warn(f"SyncPointWarner: host-device synchronisation at {site.location} in {site.function}(): "
                       f"{site.kind}: {site.op}", category=SyncPointWarning)

    # ---- window ----------------------------------------------------------------------------------

    def _open(self) -> None:
        if self._active:
            return
        if _get_current_dispatch_mode() is not None:
            return  # another dispatch mode (a profiler of ours) owns this step; modes must nest cleanly
        watch = SyncWatch(self.recorder, device_type=self._device_type, detector=self.detector)
        watch.__enter__()
        self._active.append(watch)

    def _close(self, completed_step: bool = False) -> None:
        if completed_step and self._active:
            self.sampled_steps.append(self._step)
        while self._active:
            self._active.pop().__exit__(None, None, None)

    # ---- hooks -----------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device_type = device_of(trainer, pl_module).type
        try:
            detector_plan(self.detector, self._device_type)
        except ValueError as err:
            raise ValueError(f"SyncPointWarner: {err}") from None
        self._step = 0
        if self.sampler(0):
            self._open()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._close(completed_step=True)
        self._step += 1
        if self.sampler(self._step):
            self._open()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()
        framework = self.framework_sites()
        if framework:
            rank_zero_info("SyncPointWarner: framework syncs on sampled steps:\n" +
                           "\n".join(f"  {s.describe()}" for s in framework))

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    # ---- results -----------------------------------------------------------------------------------

    def user_sites(self) -> list[SyncSite]:
        return sorted(self.recorder.user_sites(), key=lambda s: -s.count)

    def framework_sites(self) -> list[SyncSite]:
        return sorted(self.recorder.framework_sites(), key=lambda s: -s.count)

    def sites_of_kind(self, kind: str) -> list[SyncSite]:
        if kind not in SYNC_KINDS:
            raise ValueError(f"kind must be one of {sorted(SYNC_KINDS)}, got {kind!r}")
        return [s for s in self.user_sites() + self.framework_sites() if s.kind == kind]

    def summary(self) -> dict[str, Any]:
        return {
            "sampled_steps": list(self.sampled_steps),
            "user": [s.describe() for s in self.user_sites()],
            "framework": [s.describe() for s in self.framework_sites()],
            "sites": [s.as_dict() for s in self.user_sites() + self.framework_sites()],
        }

