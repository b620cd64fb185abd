"""Models of the pack."""

from lightning_perf.models.gpt import GPT, PRESETS, GPTConfig, GPTLightningModule, generate

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "PRESETS", "generate"]
