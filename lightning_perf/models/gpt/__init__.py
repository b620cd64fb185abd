"""The GPT: config presets, the nn.Module and its LightningModule."""

from lightning_perf.models.gpt.config import PRESETS, GPTConfig
from lightning_perf.models.gpt.model import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS"]
