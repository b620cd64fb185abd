"""Alias module: code that imports ``lightning_perf.parallel.zero`` keeps working.

``ZeroConfig`` lives in ``zero_config``, ``find_model`` in ``fsdp`` and ``deepspeed_config``
in ``deepspeed_engine``; import them from there.
"""

from lightning_perf.parallel.deepspeed_engine import deepspeed_config
from lightning_perf.parallel.fsdp import find_model
from lightning_perf.parallel.zero_config import DEEPSPEED_EXTRA, ZeroConfig, require_deepspeed

__all__ = ["ZeroConfig", "require_deepspeed", "find_model", "deepspeed_config", "DEEPSPEED_EXTRA"]
