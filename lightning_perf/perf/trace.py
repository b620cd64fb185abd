"""Profiler traces on disk: one export of a finished ``torch.profiler.profile``, two readers.

``export_traces`` writes the profile once through ``torch.profiler.tensorboard_trace_handler``
(``<out_dir>/<tb_dir>/<worker>.<time>.pt.trace.json.gz``, the layout TensorBoard's profiler plugin
reads) and copies that file to ``<out_dir>/<stem>.json.gz`` for Perfetto or ``chrome://tracing``
(both are the Chrome trace format). ``load_trace`` reads either back.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from typing import Any, Optional

import torch

__all__ = ["export_traces", "load_trace"]


def export_traces(prof: Any, out_dir: str, stem: str, *, chrome: bool = True, tensorboard: bool = True,
                  worker_name: Optional[str] = None, tb_dir: str = "tb_trace") -> list[str]:
    """Write a finished profile as a Chrome trace and/or a TensorBoard trace; return the paths written."""
    if not (chrome or tensorboard):
        return []
    board = os.path.join(out_dir, tb_dir)
    os.makedirs(board, exist_ok=True)
    before = set(os.listdir(board))
    torch.profiler.tensorboard_trace_handler(board, worker_name=worker_name, use_gzip=True)(prof)
    [written] = sorted(set(os.listdir(board)) - before)
    exported = os.path.join(board, written)
    files = []
    if chrome:
        path = os.path.join(out_dir, stem + ".json.gz")
        shutil.copyfile(exported, path)
        files.append(path)
    if tensorboard:
        files.append(exported)
    else:
        os.remove(exported)
        if not os.listdir(board):
            os.rmdir(board)
    return files


def load_trace(path: str) -> dict[str, Any]:
    """A Chrome trace (``.json`` or ``.json.gz``) as a dict with ``traceEvents``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)
