"""Models of the pack."""

from lightning_perf.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
