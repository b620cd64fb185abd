"""Performance callbacks: plain Lightning callbacks that work with any LightningModule."""

from lightning_perf.callbacks.mfu import MFUMonitor

__all__ = ["MFUMonitor"]
