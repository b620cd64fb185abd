"""Lightning's notices that a ``lightning-perf`` user cannot act on, left out of the command's output.

Only these, each matched by its text and where it comes from:

- the tips advertising ``litlogger`` and ``litmodels`` that every ``fit`` logs (Lightning's rank-zero logger);
- torch's ``FutureWarning`` that ``LeafSpec`` is deprecated, which Lightning's own pytree helper triggers.

Everything else Lightning logs or warns stays as it is. (torchao's import-time messages are filtered where the
pack imports torchao: :mod:`lightning_perf.kernels.torchao_fp8`.)
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

__all__ = ["lightning_notices_filtered", "LightningTips", "LEAFSPEC_MESSAGE", "LEAFSPEC_MODULES"]

# the loggers Lightning's rank_zero_info writes through (lightning.pytorch's replaces fabric's on import;
# the standalone pytorch_lightning / lightning_fabric packages have their own names)
_RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "pytorch_lightning.utilities.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)
_TIP = re.compile(r"Tip: .*\binstall\w* \[(litlogger|litmodels)\]")
# torch >= 2.10 deprecates LeafSpec; Lightning's utilities/_pytree.py still builds one
LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
LEAFSPEC_MODULES = r"(lightning\.pytorch|pytorch_lightning|lightning\.fabric|lightning_fabric)\."


class LightningTips(logging.Filter):
    """Drops Lightning's tips that advertise installing ``litlogger`` / ``litmodels``; passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format is not ours to judge
            return True
        return _TIP.search(message) is None


@contextlib.contextmanager
def lightning_notices_filtered() -> Iterator[None]:
    """Within the block, the notices of the module docstring are dropped; the filters are removed after."""
    tips = LightningTips()
    loggers = [logging.getLogger(name) for name in _RANK_ZERO_LOGGERS]
    for logger in loggers:
        logger.addFilter(tips)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LEAFSPEC_MESSAGE, category=FutureWarning,
                                    module=LEAFSPEC_MODULES)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(tips)
