"""Lightning plugins of the pack."""

from lightning_perf.plugins.precision import PRECISIONS, PerfPrecision

__all__ = ["PRECISIONS", "PerfPrecision"]
