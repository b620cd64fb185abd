"""lightning_perf: strategies, callbacks, kernels and precision plugins for fast LLM training with Lightning."""

__version__ = "0.1.0"
