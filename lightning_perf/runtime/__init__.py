"""Lightning-side pieces that both the model and the adapters (strategies, callbacks, CLI) attach to a
fit: below the adapters, above the pure torch layers. It imports nothing of ``models`` or the adapters."""

from lightning_perf.runtime.preemption import Preempted, PreemptionCheckpoint, attach_preemption

__all__ = ["Preempted", "PreemptionCheckpoint", "attach_preemption"]
