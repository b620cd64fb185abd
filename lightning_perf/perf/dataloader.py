"""Input-pipeline stall maths and advice derived from an actual ``DataLoader``.

Exposed wait of one step: the host time spent fetching the next batch that the
accelerator queue did not hide. With CUDA events around the gap between two steps,
the device idles for ``gap_device`` (from "previous step's work ends" to "next step
starts"); the host spent ``fetch_host`` seconds fetching, so

    exposed = min(fetch_host, gap_device)

On CPU nothing runs asynchronously and ``exposed = fetch_host``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["exposed_wait", "dataloader_advice"]


def exposed_wait(fetch_host_s: float, device_gap_s: Optional[float]) -> float:
    """Exposed input wait of one step (``device_gap_s=None`` on CPU)."""
    if fetch_host_s < 0:
        raise ValueError(f"fetch time must be >= 0, got {fetch_host_s}")
    if device_gap_s is None:
        return fetch_host_s
    return max(0.0, min(fetch_host_s, device_gap_s))


def dataloader_advice(loader: Any, *, accelerator: str = "cpu", processes_per_node: int = 1,
                      cpu_count: Optional[int] = None) -> list[str]:
    """Concrete suggestions for a ``torch.utils.data.DataLoader`` (any object with its attributes)."""
    cpus = cpu_count if cpu_count is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                    else os.cpu_count() or 1)
    per_proc = max(1, cpus // max(1, processes_per_node))
    workers = int(getattr(loader, "num_workers", 0) or 0)
    tips: list[str] = []
    if workers == 0:
        tips.append(
            f"num_workers=0 loads batches in the training process; try num_workers={min(8, per_proc)} "
            f"({cpus} CPUs / {processes_per_node} processes on this node)"
        )
    elif workers < min(4, per_proc):
        tips.append(f"num_workers={workers}: raise it towards {min(8, per_proc)} ({per_proc} CPUs per process)")
    elif workers > per_proc:
        tips.append(f"num_workers={workers} exceeds the {per_proc} CPUs per process; workers compete for cores")
    if accelerator == "cuda" and not getattr(loader, "pin_memory", False):
        tips.append("pin_memory=False: host-to-device copies come from pageable memory and block the host; "
                    "set pin_memory=True")
    if workers > 0:
        prefetch = getattr(loader, "prefetch_factor", None) or 2
        if prefetch <= 2:
            tips.append(f"prefetch_factor={prefetch}: a deeper queue (4) absorbs slow batches")
        if not getattr(loader, "persistent_workers", False):
            tips.append("persistent_workers=False restarts the workers every epoch; set persistent_workers=True")
    if not tips:
        tips.append("the loader is configured well; the dataset itself is slow (decode/tokenise offline, "
                    "memory-map pre-tokenised data)")
    return tips
