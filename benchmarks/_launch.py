"""Process groups for the multi-GPU benchmarks: one spawned process per GPU, a deadline, JSON per rank."""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable, Optional

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: Callable, args: tuple, world: int, timeout: float) -> Optional[str]:
    """Run ``worker(rank, world, port, *args)`` on ``world`` processes; kill them at ``timeout``.

    Returns an error message (timeout or a failed rank) or ``None``; never raises, so one
    broken variant cannot end the benchmark.
    """
    ctx = mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    error = None
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                error = f"timed out after {timeout:.0f}s"
                break
    except Exception as e:
        error = f"{type(e).__name__}: {e}"[-2000:]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    return error


def read_ranks(path_of_rank: Callable[[int], str], world: int) -> list[dict[str, Any]]:
    """The JSON results the ranks wrote (a rank that died before writing is left out)."""
    results = []
    for r in range(world):
        try:
            with open(path_of_rank(r)) as f:
                results.append(json.load(f))
        except OSError:
            continue
    return results
