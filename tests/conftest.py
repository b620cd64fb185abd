"""Shared test helpers live beside this file (``_spawn.py``, ``_warm.py``, ``_gpu.py``); make them importable from
every folder. GPU-only tests (``@pytest.mark.gpu``) are skipped here on a machine without CUDA, and the GPU run's
options live here: ``--gpu-slow`` and ``--gpu-shard`` (``_gpu.py``; ``tests/gpu_split.sh`` runs the shards)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cpu_fp8  # noqa: E402,F401  (torch._scaled_mm on CPU tensors at fp32-matmul speed)
from _gpu import ON_GPU, add_gpu_options, parse_shard, select_gpu_items, use_gpu_run_tuning  # noqa: E402


def pytest_addoption(parser):
    add_gpu_options(parser)


def pytest_configure(config):
    if config.getoption("gpu_shard"):
        parse_shard(config.getoption("gpu_shard"))  # a bad value is refused before collection


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: the shards split what is left
def pytest_collection_modifyitems(config, items):
    select_gpu_items(config, items)


@pytest.fixture(autouse=True)
def _gpu_run_tuning(request, monkeypatch):
    """On a GPU, the kernels launch with this run's configurations (``_gpu.py``): the first candidate of each,
    or with ``--gpu-slow`` the fastest of all. Off the GPU nothing changes (the tuner times nothing there)."""
    if ON_GPU:
        use_gpu_run_tuning(monkeypatch, slow=request.config.getoption("gpu_slow"))
    yield


def pytest_terminal_summary(terminalreporter):
    """Name the variables that made processes start fresh instead of forked from the warm interpreter."""
    fresh = sys.modules.get("_warm") and sys.modules["_warm"].FRESH_STARTS
    if fresh:
        terminalreporter.write_line(
            "processes started fresh (their environment differed from the fork server's in): "
            + ", ".join(f"{name} ({n})" for name, n in sorted(fresh.items())))


# what Lightning's launcher writes into os.environ when a test fits a pack strategy in the pytest process
# itself (it does so for one device too): left behind, the next in-process fit takes its processes for
# externally started ones and a later subprocess inherits a port that is already bound
# (restored to what the session started with: a module-scoped fixture that fits runs before a test's own)
# (and its OMP_NUM_THREADS / torch thread count: a later warm start would differ from the fork server's
# environment and start a fresh interpreter, and in-process tests would run on one thread)
_LAUNCH_ENV = ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK",
               "OMP_NUM_THREADS")
_SESSION_LAUNCH_ENV = {k: os.environ.get(k) for k in _LAUNCH_ENV}
_SESSION_THREADS = None  # torch's intra-op threads when the first test started


@pytest.fixture(autouse=True)
def _in_process_launch_state():
    import torch

    global _SESSION_THREADS
    if _SESSION_THREADS is None:
        _SESSION_THREADS = torch.get_num_threads()
    yield
    if torch.get_num_threads() != _SESSION_THREADS:
        torch.set_num_threads(_SESSION_THREADS)
    for key, value in _SESSION_LAUNCH_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a one-process group an in-process fit made
        dist.destroy_process_group()
