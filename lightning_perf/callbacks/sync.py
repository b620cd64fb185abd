"""SyncPointWarner: host-device synchronisations on sampled steps, attributed to source lines."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from typing_extensions import override

from lightning_perf.callbacks._utils import StepSampler, device_of
from lightning_perf.perf.sync import CudaSyncCatcher, DispatchSyncDetector, SyncPointError, SyncRecorder, SyncSite

__all__ = ["SyncPointWarner", "SyncPointWarning", "SyncPointError"]


class SyncPointWarning(UserWarning):
    """A line of user code synchronised the host with the device."""


class SyncPointWarner(Callback):
    """Find the lines that make the host wait for the device, on sampled steps only.

    A sampled step is watched from the end of the previous batch to the end of its own
    (so the batch fetch and transfer, the step, the optimizer and the loop's bookkeeping
    are all inside). Detectors:

    * ``"dispatch"`` (default on CPU): the aten ops that synchronise on a GPU (``.item()``,
      ``nonzero``, boolean masks, device-to-host and pageable non-blocking copies), so a
      laptop run shows the sites before the GPU run;
    * ``"cuda"`` (default on CUDA): ``torch.cuda.set_sync_debug_mode`` plus wrappers of
      ``torch.cuda.synchronize`` and ``Event``/``Stream.synchronize``, which it misses;
    * ``"both"``.

    Each site is attributed to the innermost frame outside torch; a site in Lightning or
    in this package is the framework's (reported separately, with the user's calling line).
    ``mode="warn"`` warns once per user site; ``mode="error"`` raises ``SyncPointError`` at
    the user's line (for CI). Framework sites never raise.

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
        if detector not in ("auto", "dispatch", "cuda", "both"):
            raise ValueError(f"detector must be 'auto', 'dispatch', 'cuda' or 'both', got {detector!r}")
        self.mode = mode
        self.sampler = StepSampler(every=every_n_steps, start=start_step)
        self.detector = detector
        self.recorder = SyncRecorder(on_new=self._on_new_site, raise_on_user=mode == "error")
        self.sampled_steps: list[int] = []
        self._active: list[Any] = []
        self._step = 0
        self._use_dispatch = self._use_cuda = False

    def _on_new_site(self, site: SyncSite) -> None:
        if site.framework or self.mode != "warn":
            return
        rank_zero_warn(f"SyncPointWarner: host-device synchronisation at {site.location} in {site.function}(): "
                       f"{site.op}", category=SyncPointWarning)

    # ---- window ----------------------------------------------------------------------------------

    def _open(self) -> None:
        if self._active:
            return
        if self._use_dispatch and _get_current_dispatch_mode() is not None:
            return  # another dispatch mode (a profiler of ours) owns this step; modes must nest cleanly
        if self._use_cuda:
            catcher = CudaSyncCatcher(self.recorder)
            catcher.__enter__()
            self._active.append(catcher)
        if self._use_dispatch:
            mode = DispatchSyncDetector(self.recorder)
            mode.__enter__()
            self._active.append(mode)

    def _close(self, completed_step: bool = False) -> None:
        if completed_step and self._active:
            self.sampled_steps.append(self._step)
        while self._active:
            self._active.pop().__exit__(None, None, None)

    # ---- hooks -----------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cuda = device_of(trainer, pl_module).type == "cuda"
        choice = self.detector if self.detector != "auto" else ("cuda" if cuda else "dispatch")
        if choice in ("cuda", "both") and not cuda:
            raise ValueError(f"SyncPointWarner(detector={self.detector!r}) needs a CUDA device; use 'dispatch' on CPU")
        self._use_cuda = choice in ("cuda", "both")
        self._use_dispatch = choice in ("dispatch", "both")
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

    def summary(self) -> dict[str, Any]:
        return {
            "sampled_steps": list(self.sampled_steps),
            "user": [s.describe() for s in self.user_sites()],
            "framework": [s.describe() for s in self.framework_sites()],
        }

