"""Process groups for the multi-GPU benchmarks: one spawned process per GPU, a deadline, JSON per rank."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank: int, world: int, port: int, smoke: bool) -> tuple[torch.device, torch.dtype]:
    """In a spawned rank: its process group (NCCL on GPU ``rank``; gloo on the CPU under ``smoke``);
    returns the rank's device and the dtype to measure in (bf16 on a GPU, fp32 on the CPU)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", rank=rank, world_size=world)
    return device, torch.float32 if smoke else torch.bfloat16


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
