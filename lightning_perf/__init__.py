"""lightning_perf: strategies, callbacks, kernels and precision plugins for fast LLM training with Lightning.

Importing the package registers the strategy names (``zero1``, ``zero2``, ``zero3``,
``zero2_offload``, ``zero3_offload``, ``parallel3d``) in Lightning's ``StrategyRegistry``.
"""

from lightning_perf.runtime.planning import estimate_memory
from lightning_perf.strategies import register_strategies

__version__ = "0.1.0"
__all__ = ["__version__", "estimate_memory", "register_strategies"]

register_strategies()
