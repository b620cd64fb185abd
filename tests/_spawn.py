"""Run a test function on N CPU processes (gloo) and collect each rank's result.

Ranks are forked from the warm interpreter of ``_warm.py`` (spawned where it cannot serve), under
the caller's environment. A rank writes its output to ``rank{r}.log`` and, when it raises, its
traceback to ``rank{r}.err``; a group that does not finish in ``timeout`` seconds dumps its ranks'
stacks into their logs, is killed and fails the test with both, so a hung collective never hangs
the suite and shows where it hung.

``launch_nodes`` starts a script as a cluster would on each of several "nodes" of this machine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.multiprocessing as mp
from _warm import context, enter, start, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enter_rank(rank: int, world: int, port: int, out_dir: str, env: dict) -> None:
    """A forked rank's first steps: its output to ``rank{r}.log``, the caller's environment, and what a
    launcher sets (Lightning's strategies create the process group from these)."""
    log = os.open(Path(out_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    enter(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def _entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, init_group: bool, env: dict) -> None:
    import torch.distributed as dist

    enter_rank(rank, world, port, out_dir, env)
    warnings.filterwarnings("ignore")
    if init_group:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, Path(out_dir)), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world: int, out_dir: Path, timeout: float = 240.0, *, init_group: bool = False) -> list[Any]:
    """``fn(rank, world, out_dir)`` on ``world`` spawned processes; returns the ranks' results in order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    method = "spawn" if context() is None else "forkserver"
    ctx = mp.start_processes(_entry, args=(fn, world, free_port(), str(out_dir), init_group, dict(os.environ)),
                             nprocs=world, join=False, start_method=method)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout}s")
    except Exception as e:
        stop([p.pid for p in ctx.processes if p.is_alive()])
        for p in ctx.processes:
            p.join()
        errs = "\n".join(f.read_text() for f in sorted(out_dir.glob("rank*.err")))
        logs = "\n".join(f"--- {f.name} (end)\n{f.read_text(errors='replace')[-3000:]}"
                         for f in sorted(out_dir.glob("rank*.log")))
        pytest.fail(f"{e}\n{errs}\n{logs}")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def launch_nodes(script: Path, out_dir: Path, *, nodes: int, devices: int, timeout: float = 300.0) -> list[Any]:
    """``python script out_dir`` once per node, as a cluster starts a job: ``NODE_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``WORLD_SIZE`` set, no ``LOCAL_RANK`` (Lightning's launcher in each node's
    script starts the node's other ``devices - 1`` processes). Each rank saves its result to
    ``out_dir/rank{r}.pt``; returns them in global rank order. A launch that fails shows its node's
    output; one that does not finish in ``timeout`` seconds is killed, launchers and their children.

    The nodes are forked from the warm interpreter (``_warm.start``), their launchers' processes too,
    with as many threads each as Lightning's launcher gives a process of ``devices`` on this machine;
    where they cannot be, each is a fresh interpreter with one thread and the repository on its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(nodes * devices)}
    env.pop("LOCAL_RANK", None)  # each node's launcher starts its local ranks itself
    root = str(Path(__file__).resolve().parent.parent)  # the repository: the package under test
    fresh = {**env, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}
    started = [start([script, out_dir], env={**env, "NODE_RANK": str(n)}, fresh_env={**fresh, "NODE_RANK": str(n)})
               for n in range(nodes)]
    deadline = time.monotonic() + timeout
    runs = []
    try:
        for command in started:
            runs.append(command.finish(max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired as e:
        for command in started[len(runs) + 1:]:  # the nodes still running: finish(0) stops each one
            with contextlib.suppress(subprocess.TimeoutExpired):  # and reports that it had to
                command.finish(0)
        pytest.fail(f"the {nodes}-node launch of {Path(script).name} did not finish in {timeout}s\n{e}")
    for n, run in enumerate(runs):
        assert run.returncode == 0, f"node {n}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(nodes * devices)]
