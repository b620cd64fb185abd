"""``RankWatchdog``: name the dead rank (or the mismatched steps) when a collective fails.

A thin adapter over :class:`lightning_perf.parallel.watchdog.PeerWatchdog`: heartbeats
start in ``setup`` once the process group exists, each training batch records its step
(an integer store, no I/O), and ``on_exception`` replaces a failed collective's transport
error or timeout by a :class:`RankFailureError` / :class:`CollectiveTimeoutError` that
names the rank at fault. How fast a rank notices is bounded by the strategy's
``timeout`` (``ZeroStrategy(timeout=...)``, ``Parallel3DStrategy(timeout=...)``), which
both gloo and NCCL honour; a killed peer is usually noticed at once (its sockets close).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from typing_extensions import override

from lightning_perf.parallel.watchdog import CollectiveTimeoutError, PeerWatchdog, RankFailureError

__all__ = ["RankWatchdog", "RankFailureError", "CollectiveTimeoutError"]


class RankWatchdog(pl.Callback):
    """Heartbeats between ranks; a failed collective is reported with the dead rank's number.

    Args:
        interval: seconds between heartbeats.
        dead_after: seconds of silence after which a rank counts as dead; keep it below
            the strategy's collective ``timeout``.
    """

    def __init__(self, interval: float = 0.5, dead_after: float = 5.0) -> None:
        if interval <= 0 or dead_after <= interval:
            raise ValueError(f"need 0 < interval < dead_after, got interval={interval}, dead_after={dead_after}")
        self.interval = interval
        self.dead_after = dead_after
        self.watchdog: Optional[PeerWatchdog] = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.watchdog is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.watchdog = PeerWatchdog(interval=self.interval, dead_after=self.dead_after).start()
            self.watchdog.beat(trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(trainer.global_step)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.watchdog is not None:
            self.watchdog.stop(done=True)
            self.watchdog = None

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is None or isinstance(exception, (RankFailureError, CollectiveTimeoutError, KeyboardInterrupt)):
            return
        error = watchdog.diagnose(exception)
        watchdog.stop(done=False)
        if error is not None:
            raise error from exception
