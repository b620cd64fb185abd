"""The GPT: config presets, the nn.Module and its LightningModule."""

from lightning_perf.models.gpt.config import PRESETS, GPTConfig
from lightning_perf.models.gpt.generate import generate
from lightning_perf.models.gpt.model import GPT
from lightning_perf.models.gpt.module import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "PRESETS", "generate"]
