"""Autotuning of kernel launch configurations, cached in memory and on disk.

A launcher hands :meth:`KernelTuner.pick` its candidate configurations (block
sizes, ``num_warps``, ``num_stages``) and a function that launches the kernel
with one of them. On a CUDA device each candidate is timed once with CUDA
events and the fastest is kept, in memory and in a JSON file per (kernel, GPU
name) whose keys hold the shape bucket and dtype, so a second run starts
without re-tuning. Elsewhere (the CPU interpreter) the first candidate is used
and nothing is timed. The file's name holds the torch and Triton versions too
(:func:`software_versions`): a configuration timed under one is never read under another.

The files are safe to share between concurrent runs: each write re-reads the
file, merges, writes a temporary file beside it and ``os.replace``-s it in.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["AutotuneCache", "KernelTuner", "default_tuner", "configure", "shape_bucket", "hold_gpu",
           "software_versions", "default_cache_dir"]

log = logging.getLogger(__name__)

Config = dict[str, Any]


def shape_bucket(n: int, lo: int = 16, hi: int = 1 << 20) -> int:
    """Round ``n`` up to a power of two in [lo, hi]: shapes in one bucket share a tuned config."""
    b = lo
    while b < n and b < hi:
        b *= 2
    return b


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "device"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "lightning_perf" / "autotune"


def software_versions() -> str:
    """``torch-<version>--triton-<version>``: what a timing depends on besides the GPU and the shape (the
    compiler that built the kernel, the library around it)."""
    from importlib.metadata import PackageNotFoundError, version

    triton = "none"
    for dist in ("triton", "pytorch-triton"):
        try:
            triton = version(dist)
            break
        except PackageNotFoundError:
            continue
    return f"torch-{torch.__version__}--triton-{triton}"


@dataclass(kw_only=True)
class AutotuneCache:
    """Tuned configurations on disk: ``<directory>/<kernel>--<gpu name>--<software>.json`` = {key: config},
    ``software`` being :func:`software_versions`."""

    directory: Path = field(default_factory=default_cache_dir)
    enabled: bool = True
    software: str = field(default_factory=software_versions)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).expanduser()

    def path(self, kernel: str, device_name: str) -> Path:
        return self.directory / f"{_slug(kernel)}--{_slug(device_name)}--{_slug(self.software)}.json"

    def _read(self, path: Path) -> dict[str, Config]:
        try:
            with open(path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def load(self, kernel: str, device_name: str, key: str) -> Optional[Config]:
        if not self.enabled:
            return None
        return self._read(self.path(kernel, device_name)).get(key)

    def store(self, kernel: str, device_name: str, key: str, config: Config) -> None:
        """Merge one entry into the file; temp file + ``os.replace`` so readers never see half a file."""
        if not self.enabled:
            return
        path = self.path(kernel, device_name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = self._read(path)
            data[key] = config
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as err:  # a read-only or full disk must not stop training
            log.warning("could not write autotune cache %s: %s", path, err)


class KernelTuner:
    """Picks the fastest launch configuration per key; memory cache in front of an :class:`AutotuneCache`."""

    def __init__(self, cache: Optional[AutotuneCache] = None, *, warmup: int = 1, repeat: int = 5) -> None:
        if warmup < 0 or repeat < 1:
            raise ValueError(f"warmup ({warmup}) must be >= 0 and repeat ({repeat}) >= 1")
        self.cache = cache if cache is not None else AutotuneCache()
        self.warmup = warmup
        self.repeat = repeat
        self._memory: dict[tuple[str, str, str], Config] = {}  # (kernel, GPU name, key) -> config
        self._fast: dict[tuple, Config] = {}  # (kernel, key, device index) -> config

    def pick(
        self,
        kernel: str,
        key: Sequence[Any],
        configs: Sequence[Config],
        launch: Callable[[Config], Any],
        device: torch.device,
    ) -> Config:
        """The config to use for ``kernel`` at ``key`` (shape bucket, dtype, flags).

        ``launch(config)`` must run the kernel once with ``config`` and have no side effect
        beyond writing its outputs (it may be called several times).
        """
        # hot path first: this runs on every kernel call, so no strings or device queries before the hit
        fast_key = (kernel, tuple(key), device.index)
        hit = self._fast.get(fast_key)
        if hit is not None:
            return hit
        if not configs:
            raise ValueError(f"no launch configuration given for kernel {kernel!r}")
        if device.type != "cuda" or len(configs) == 1:
            return configs[0]
        device_name = self.device_name(device)
        key_str = "|".join(str(k) for k in key)
        mem_key = (kernel, device_name, key_str)
        if mem_key in self._memory:
            self._fast[fast_key] = self._memory[mem_key]
            return self._memory[mem_key]
        cached = self.cache.load(kernel, device_name, key_str)
        if cached is not None and cached in [dict(c) for c in configs]:
            self._memory[mem_key] = self._fast[fast_key] = cached
            return cached
        best, best_ms, timings = None, float("inf"), []
        for cfg in configs:
            try:
                ms = self._time(launch, dict(cfg))
            except Exception as err:  # e.g. out of shared memory for this block size
                log.debug("config %s of %s failed: %s", cfg, kernel, err)
                continue
            timings.append((ms, cfg))
            if ms < best_ms:
                best, best_ms = dict(cfg), ms
        if best is None:
            raise RuntimeError(f"every launch configuration of {kernel} failed for key {key_str}")
        log.info("autotuned %s [%s] on %s: %s (%.3f ms of %d configs)", kernel, key_str, device_name, best, best_ms,
                 len(timings))
        self._memory[mem_key] = self._fast[fast_key] = best
        self.cache.store(kernel, device_name, key_str, best)
        return best

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def _time(self, launch: Callable[[Config], Any], cfg: Config) -> float:
        for _ in range(max(1, self.warmup)):  # the first call compiles
            launch(cfg)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launch(cfg)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A short kernel (norms, activations: tens of microseconds) finishes before the host has
        # launched the next one, so a plain event pair times the Python launch path, not the kernel.
        # Keep the GPU busy while the launches are queued: the window then holds GPU time only.
        hold_gpu(2.0 * self.repeat * host_s + 50e-6)
        start.record()
        for _ in range(self.repeat):
            launch(cfg)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.repeat


# cycles of torch.cuda._sleep per second: above any current GPU clock, so a hold is never too short
_SLEEP_CYCLES_PER_S = 2.5e9
_MAX_HOLD_S = 0.05


def hold_gpu(seconds: float) -> None:
    """Queue a spin kernel of about ``seconds`` on the current stream (capped at 50 ms).

    Launches queued behind it run back to back once it ends, so CUDA events around them
    measure device time even when the host needs longer to launch them than the GPU to run them.
    """
    cycles = int(min(max(seconds, 0.0), _MAX_HOLD_S) * _SLEEP_CYCLES_PER_S)
    if cycles > 0:
        torch.cuda._sleep(cycles)


class _Default:
    """The per-process tuner the functional kernels use; replace it with :func:`configure`."""

    tuner: Optional[KernelTuner] = None


def default_tuner() -> KernelTuner:
    if _Default.tuner is None:
        _Default.tuner = KernelTuner()
    return _Default.tuner


def configure(*, cache_dir: Optional[os.PathLike | str] = None, disk_cache: bool = True, repeat: int = 5) -> KernelTuner:
    """Set where tuned configurations are stored (default ``~/.cache/lightning_perf/autotune``)."""
    cache = AutotuneCache(directory=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
                          enabled=disk_cache)
    _Default.tuner = KernelTuner(cache, repeat=repeat)
    return _Default.tuner
