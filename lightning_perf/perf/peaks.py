"""Dense datasheet peaks per device: FLOP/s per compute dtype and memory bandwidth.

Values are dense (no 2:4 sparsity) tensor-core peaks from the vendors' datasheets and
architecture whitepapers. Consumer cards are listed with FP32 accumulation (what
training uses), which is half the FP16-accumulate figure. AMD MI250X is listed per
GCD: each GCD is one ``torch.device`` (and ``torch.cuda.get_device_name`` names each
one "AMD Instinct MI250X"), so it is half the per-package figure.

Names are matched on what drivers actually report (``torch.cuda.get_device_name``),
e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

__all__ = ["DevicePeak", "PEAKS", "DTYPES", "lookup_peak", "device_peak", "compute_dtype_name"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

T = 1e12  # TFLOP/s
TB = 1e12  # TB/s


@dataclass(frozen=True, kw_only=True)
class DevicePeak:
    """Peak dense FLOP/s per dtype (``None`` = unsupported) and memory bandwidth in bytes/s."""

    name: str
    flops: dict[str, Optional[float]] = field(default_factory=dict)
    memory_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        unknown = set(self.flops) - set(DTYPES)
        if unknown:
            raise ValueError(f"DevicePeak({self.name!r}): unknown dtypes {sorted(unknown)}; use {DTYPES}")
        if self.memory_bandwidth < 0:
            raise ValueError(f"DevicePeak({self.name!r}): memory_bandwidth must be >= 0, got {self.memory_bandwidth}")

    def flops_for(self, dtype: str) -> Optional[float]:
        """Peak FLOP/s for ``dtype`` (one of ``DTYPES``); ``None`` when the device has no such unit."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        return self.flops.get(dtype)


def _peak(name: str, fp32: float, tf32: Optional[float], bf16: Optional[float], fp16: Optional[float],
          fp8: Optional[float], bw: float) -> DevicePeak:
    def scale(x: Optional[float]) -> Optional[float]:
        return None if x is None else x * T

    return DevicePeak(
        name=name,
        flops={"fp32": scale(fp32), "tf32": scale(tf32), "bf16": scale(bf16), "fp16": scale(fp16), "fp8": scale(fp8)},
        memory_bandwidth=bw * TB,
    )


# key: canonical name           fp32    tf32    bf16     fp16     fp8      TB/s
PEAKS: dict[str, DevicePeak] = {
    p.name: p
    for p in (
        _peak("B200", 75.0, 1125.0, 2250.0, 2250.0, 4500.0, 8.0),
        _peak("H200 SXM", 67.0, 494.7, 989.4, 989.4, 1978.9, 4.8),
        _peak("H200 NVL", 60.0, 417.5, 835.5, 835.5, 1670.5, 4.8),
        _peak("H100 SXM", 67.0, 494.7, 989.4, 989.4, 1978.9, 3.35),
        _peak("H100 NVL", 60.0, 417.5, 835.5, 835.5, 1670.5, 3.9),
        _peak("H100 PCIe", 51.0, 378.0, 756.0, 756.0, 1513.0, 2.0),
        _peak("A100 SXM 80GB", 19.5, 156.0, 312.0, 312.0, None, 2.039),
        _peak("A100 SXM 40GB", 19.5, 156.0, 312.0, 312.0, None, 1.555),
        _peak("A100 PCIe 80GB", 19.5, 156.0, 312.0, 312.0, None, 1.935),
        _peak("A100 PCIe 40GB", 19.5, 156.0, 312.0, 312.0, None, 1.555),
        _peak("L40S", 91.6, 183.0, 362.0, 362.0, 733.0, 0.864),
        _peak("L4", 30.3, 60.0, 121.0, 121.0, 242.0, 0.3),
        # NVIDIA publishes no A10G sheet; the A10 datasheet values (same GA102 die)
        _peak("A10G", 31.2, 62.5, 125.0, 125.0, None, 0.6),
        _peak("RTX 4090", 82.6, 82.6, 165.2, 165.2, 330.3, 1.008),
        _peak("RTX 3090", 35.6, 35.6, 71.0, 71.0, None, 0.936),
        _peak("MI300X", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 5.3),
        # per GCD (one torch device): half of the OAM package's 383 TFLOP/s and 3.2 TB/s
        _peak("MI250X", 47.9, None, 191.5, 191.5, None, 1.6),
    )
}

# (pattern on the lower-cased driver name, canonical key); first match wins, so the
# more specific patterns come first.
_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"b200", "B200"),
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200 SXM"),  # "NVIDIA H200" is the SXM part's plain name
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*(pcie|hbm2e)", "H100 PCIe"),
    (r"h100", "H100 SXM"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100"
    (r"a100.*pcie.*40|a100.*40.*pcie", "A100 PCIe 40GB"),
    (r"a100.*pcie", "A100 PCIe 80GB"),
    (r"a100.*80", "A100 SXM 80GB"),
    (r"a100", "A100 SXM 40GB"),
    (r"l40s", "L40S"),
    (r"\bl4\b", "L4"),
    (r"a10g", "A10G"),
    (r"rtx 4090", "RTX 4090"),
    (r"rtx 3090", "RTX 3090"),
    (r"mi300x", "MI300X"),
    (r"mi250x", "MI250X"),
)


def lookup_peak(device_name: str) -> Optional[DevicePeak]:
    """The table entry for a driver-reported device name, or ``None`` when it is not known."""
    low = device_name.lower()
    for pattern, key in _PATTERNS:
        if re.search(pattern, low):
            return PEAKS[key]
    return None


def device_peak(device: Union[torch.device, str, None] = None) -> Optional[DevicePeak]:
    """Peak of a CUDA/ROCm device (current one by default); ``None`` for CPU or unknown devices."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return lookup_peak(torch.cuda.get_device_name(dev))


_PRECISION_DTYPES = {
    "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16",
    "16": "fp16", "16-mixed": "fp16", "16-true": "fp16", "fp16": "fp16",
    "transformer-engine": "fp8", "transformer-engine-float16": "fp8", "fp8": "fp8",
    "32": "fp32", "32-true": "fp32", "fp32": "fp32", "tf32": "tf32",
    "64": "fp32", "64-true": "fp32",
}


def compute_dtype_name(precision: Union[str, int, None], float32_matmul_precision: str = "highest") -> str:
    """Map a Lightning precision string to the peak-table dtype the matmuls run in.

    fp32 maps to tf32 when ``torch.get_float32_matmul_precision()`` allows it ("high" or "medium").
    """
    key = str(precision if precision is not None else "32-true").lower()
    if key not in _PRECISION_DTYPES:
        raise ValueError(f"Unknown precision {precision!r}; expected one of {sorted(_PRECISION_DTYPES)}")
    dtype = _PRECISION_DTYPES[key]
    if dtype == "fp32" and float32_matmul_precision in ("high", "medium"):
        return "tf32"
    return dtype
