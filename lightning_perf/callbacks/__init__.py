"""Performance callbacks: plain Lightning callbacks that work with any LightningModule.

Each one adds no host-device synchronisation on the steps it does not sample.
"""

from lightning_perf.callbacks._settings import run_settings_of
from lightning_perf.callbacks.comm import CommOverlapMonitor
from lightning_perf.callbacks.garbage import GarbageCollection
from lightning_perf.callbacks.memory import MemoryMonitor
from lightning_perf.callbacks.mfu import MFUMonitor
from lightning_perf.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from lightning_perf.callbacks.preemption import Preempted, PreemptionCheckpoint
from lightning_perf.callbacks.report import PerfReport
from lightning_perf.callbacks.roofline import RooflineMonitor
from lightning_perf.callbacks.stall import DataLoaderStallDetector
from lightning_perf.callbacks.sync import SyncPointError, SyncPointWarner, SyncPointWarning
from lightning_perf.callbacks.watchdog import CollectiveTimeoutError, RankFailureError, RankWatchdog

__all__ = [
    "MFUMonitor",
    "RooflineMonitor",
    "DataLoaderStallDetector",
    "SyncPointWarner",
    "SyncPointWarning",
    "SyncPointError",
    "CommOverlapMonitor",
    "PerfReport",
    "NonFiniteGuard",
    "NonFiniteError",
    "PreemptionCheckpoint",
    "Preempted",
    "RankWatchdog",
    "RankFailureError",
    "CollectiveTimeoutError",
    "GarbageCollection",
    "MemoryMonitor",
    "run_settings_of",
]
