"""A CUDA out-of-memory error during a run ends in three lines naming what to change, on every rank, once.

The full traceback goes to a log file under the run's ``default_root_dir`` (``oom_rank<R>.log``) instead of the
screen; the three lines name the settings that lower memory (``--data.batch_size``,
``--model.activation_checkpointing``, accumulation, offload) and ``lightning-perf plan``, which shows where the
memory goes before a GPU is taken.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path
from typing import Optional

import torch

from lightning_perf.cli.recipes import _config_files, _merged_recipe, _option_value

__all__ = ["is_out_of_memory", "report_out_of_memory"]

_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ([GMK]i?B)")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is a CUDA out-of-memory error."""
    seen: set[int] = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _root_dir(args: list[str]) -> Path:
    root = _option_value(args, "trainer.default_root_dir")
    if root is None:
        root = (_merged_recipe(_config_files(args)).get("trainer") or {}).get("default_root_dir")
    return Path(root) if root else Path.cwd()


def report_out_of_memory(err: BaseException, args: list[str], subcommand: str = "fit") -> int:
    """Write the traceback to the run's log file and print the three lines; the exit status to use."""
    rank = _rank()
    log = _root_dir(args) / f"oom_rank{rank}.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))
        where = str(log)
    except OSError:
        where = "(could not write the log file; run with --debug to see the traceback)"
    match = _TRIED.search(str(err))
    tried = f" (it tried to allocate {match.group(1)} {match.group(2)})" if match else ""
    lines = [
        f"lightning-perf {subcommand}: error: the GPU ran out of memory on rank {rank}{tried}.",
        "Lower the peak: --data.batch_size auto (or smaller), --model.activation_checkpointing auto / selective / "
        "full, accumulate instead of a larger micro-batch (--data.global_batch_tokens, "
        "--trainer.accumulate_grad_batches), or offload (--trainer.strategy zero3_offload); "
        "`lightning-perf plan` with the same arguments shows where the memory goes.",
        f"Full traceback: {where}",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1
