"""``PreemptionCheckpoint`` and ``Preempted``: see :mod:`lightning_perf.runtime.preemption` (it lives there
because ``GPTLightningModule`` attaches it too, and the model layer imports no adapter)."""

from lightning_perf.runtime.preemption import Preempted, PreemptionCheckpoint, attach_preemption

__all__ = ["Preempted", "PreemptionCheckpoint", "attach_preemption"]
