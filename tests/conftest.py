"""Shared test helpers live beside this file (``_spawn.py``, ``_warm.py``, ``_gpu.py``); make them importable from
every folder. GPU-only tests (``@pytest.mark.gpu``) are skipped here on a machine without CUDA (``_gpu.py``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cpu_fp8  # noqa: E402,F401  (torch._scaled_mm on CPU tensors at fp32-matmul speed)
from _gpu import apply_gpu_marker  # noqa: E402


def pytest_collection_modifyitems(config, items):
    apply_gpu_marker(items)


def pytest_terminal_summary(terminalreporter):
    """Name the variables that made processes start fresh instead of forked from the warm interpreter."""
    fresh = sys.modules.get("_warm") and sys.modules["_warm"].FRESH_STARTS
    if fresh:
        terminalreporter.write_line(
            "processes started fresh (their environment differed from the fork server's in): "
            + ", ".join(f"{name} ({n})" for name, n in sorted(fresh.items())))
