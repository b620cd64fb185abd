"""Each rank's process on the CPU cores next to its GPU (a benchmark variant's lever, not yet a default).

A training process that issues kernels from Python spends its host time in the interpreter, the
dispatcher and the launch path: memory latency decides it. On a host with several NUMA nodes the
operating system may run a rank on the socket away from its GPU (and move it between sockets), so
one rank issues its steps slower than the others, and they wait for it in every collective.
:func:`bind_to_device` restricts the calling process (and the threads and dataloader workers it
starts later) to the cores of its GPU's NUMA node, as the kernel's sysfs names them
(``/sys/bus/pci/devices/<bus id>/local_cpulist``), within the cores it may use already (a
container's cpuset is kept). Where the node cannot be read, or the intersection is empty, nothing
changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["bind_to_device", "device_local_cpus", "parse_cpulist"]

_SYSFS_PCI = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> set[int]:
    """The cores of a Linux cpulist (``"0-3,8,10-11"``)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(hi) < int(lo):
                raise ValueError(f"bad cpulist range {part!r}")
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return cpus


def _pci_bus_id(index: int) -> Optional[str]:
    """``domain:bus:device.function`` of CUDA device ``index`` (as visible to this process)."""
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(index)
    try:
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:  # a torch build whose properties lack the PCI address
        return None


def device_local_cpus(index: int, sysfs: Path = _SYSFS_PCI) -> Optional[set[int]]:
    """The cores of CUDA device ``index``'s NUMA node, or None where the host does not say."""
    bus_id = _pci_bus_id(index)
    if bus_id is None:
        return None
    try:
        text = (sysfs / bus_id / "local_cpulist").read_text()
    except OSError:
        return None
    cpus = parse_cpulist(text)
    return cpus or None


def bind_to_device(index: int, local_cpus: Optional[set[int]] = None) -> Optional[set[int]]:
    """Run this process on the cores of CUDA device ``index``'s NUMA node; returns them, or None.

    ``local_cpus`` overrides what sysfs says (tests, hosts that misreport). The binding is the
    intersection with the cores the process may use now; None (nothing changed) where either is
    unknown or the intersection is empty, or where every allowed core is local already.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    local = local_cpus if local_cpus is not None else device_local_cpus(index)
    if not local:
        return None
    allowed = os.sched_getaffinity(0)
    cpus = allowed & set(local)
    if not cpus or cpus == allowed:
        return None
    os.sched_setaffinity(0, cpus)
    return cpus
