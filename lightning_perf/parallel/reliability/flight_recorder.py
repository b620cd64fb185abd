"""The NCCL flight recorder: where each rank's last collectives go when a collective hangs, and how to read them.

torch keeps a ring buffer of every rank's recent collectives (the flight recorder). When the
NCCL watchdog times a collective out it writes each rank's buffer to ``<prefix><rank>`` (a
pickle) before it tears the process down. torch reads these variables (torch 2.11 and 2.13; the
``TORCH_FR_*`` names first, the older ``TORCH_NCCL_*`` ones are aliases):

- ``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE``: entries kept (0 turns it off), read
  when the first process group is created;
- ``TORCH_NCCL_DUMP_ON_TIMEOUT``: dump on a timeout or NCCL error, read when an NCCL group is created;
- ``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``: the dump path prefix, read when
  the first dump is written (default ``$XDG_CACHE_HOME`` or ``~/.cache``, then
  ``torch/comm_lib_trace_rank_``).

``flight_recorder_env`` says which of them to set (never one the user set under either name);
``enable_flight_recorder`` sets them. Both are called by whoever creates the process group, just
before it (the pack's strategies, through ``RankWatchdog``); nothing is set at import.
``dump_flight_recorder`` writes this rank's buffer on demand (any backend that records: NCCL, and
gloo in torch 2.13); ``collective_in_flight`` reads it in memory and names the collective this rank is
stuck in (NCCL records when each collective completes: the oldest one not completed; gloo does not: the
newest one issued); ``collective_deadline`` says when NCCL's watchdog will time that collective out (its
creation time plus its group's timeout, both in the entry); ``read_command`` is the analyser's command
line for a dump directory.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping, MutableMapping
from typing import Optional

import torch

__all__ = [
    "FLIGHT_RECORDER_VARS",
    "collective_deadline",
    "collective_in_flight",
    "default_dump_prefix",
    "dump_files",
    "dump_flight_recorder",
    "dump_prefix",
    "enable_flight_recorder",
    "flight_recorder_env",
    "read_command",
    "timeout_deadline",
]

# setting -> the names torch reads, preferred first
FLIGHT_RECORDER_VARS: dict[str, tuple[str, ...]] = {
    "buffer_size": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    "dump_on_timeout": ("TORCH_NCCL_DUMP_ON_TIMEOUT",),
    "dump_prefix": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
}
DUMP_NAME = "nccl_trace_rank_"


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> Optional[str]:
    return next((environ[n] for n in names if environ.get(n)), None)


def flight_recorder_env(prefix: str, *, buffer_size: int = 2000,
                        environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables to set for dumps at ``<prefix><rank>``: each setting the user has not made under
    any of its names, under all of its names (so older and newer torch read the same value)."""
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    environ = os.environ if environ is None else environ
    wanted = {"buffer_size": str(buffer_size), "dump_on_timeout": "1", "dump_prefix": prefix}
    out: dict[str, str] = {}
    for setting, names in FLIGHT_RECORDER_VARS.items():
        if _first_set(environ, names) is None:
            out.update({name: wanted[setting] for name in names})
    return out


def enable_flight_recorder(prefix: str, *, buffer_size: int = 2000,
                           environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set what ``flight_recorder_env`` returns (in ``os.environ`` by default) and return it."""
    environ = os.environ if environ is None else environ
    values = flight_recorder_env(prefix, buffer_size=buffer_size, environ=environ)
    environ.update(values)
    return values


def default_dump_prefix(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where torch dumps when no prefix is set."""
    environ = os.environ if environ is None else environ
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME", "/tmp"), ".cache")
    return os.path.join(cache, "torch", "comm_lib_trace_rank_")


def dump_prefix(environ: Optional[Mapping[str, str]] = None) -> str:
    """The prefix torch will dump to under ``environ``."""
    environ = os.environ if environ is None else environ
    return _first_set(environ, FLIGHT_RECORDER_VARS["dump_prefix"]) or default_dump_prefix(environ)


def dump_files(prefix: str, *, newer_than: float = 0.0) -> list[str]:
    """Existing dumps ``<prefix><rank>`` (modified after ``newer_than``, a ``time.time()``), by rank."""
    folder, stem = os.path.split(prefix)
    if not os.path.isdir(folder or "."):
        return []
    pattern = re.compile(re.escape(stem) + r"(\d+)$")
    found = []
    for name in os.listdir(folder or "."):
        m = pattern.match(name)
        path = os.path.join(folder, name)
        if m and os.path.getmtime(path) >= newer_than:
            found.append((int(m.group(1)), path))
    return [path for _, path in sorted(found)]


def _dump_function(nccl: bool, *, nccl_only: bool = False):
    """torch's function that returns this process's recorder as a pickle (None: this build has none).

    ``nccl_only``: NCCL's recorder or none (not the CPU backends', which mark no collective completed)."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    if nccl_only:
        names: tuple[str, ...] = ("_dump_nccl_trace",)
    else:
        names = ("_dump_nccl_trace", "_dump_fr_trace") if nccl else ("_dump_fr_trace",)
    return next((getattr(c10d, n) for n in names if hasattr(c10d, n)), None)


def _entries(nccl: bool, *, only_active: bool = False, nccl_only: bool = False) -> Optional[list[dict]]:
    """This process's recorder entries, oldest first; ``None`` without a recorder or when it cannot be read."""
    dump = _dump_function(nccl, nccl_only=nccl_only)
    if dump is None:
        return None
    try:  # torch's own bytes, made in this process just now
        return list(pickle.loads(dump(True, False, only_active)).get("entries") or [])
    except Exception:
        return None


def collective_in_flight(*, nccl: bool) -> Optional[str]:
    """The collective this process's flight recorder shows it in, in words; ``None`` without a recorder or entries.

    Where the recorder marks completed collectives (NCCL), the oldest one not completed (``None`` when all
    completed); where it marks none (gloo), the newest one issued. Never raises.
    """
    entries = _entries(nccl)
    if not entries:
        return None
    if any(e.get("state") == "completed" for e in entries):
        pending = [e for e in entries if e.get("state") != "completed"]
        if not pending:
            return None
        entry, how = pending[0], "in flight"
    else:
        entry, how = entries[-1], "the last one issued"
    group = entry.get("process_group") or ("?", "")
    group_id, group_name = (group[0], group[1]) if isinstance(group, (list, tuple)) and len(group) > 1 else (group, "")
    name = f" ({group_name})" if group_name and group_name != "undefined" else ""
    return (f"{entry.get('profiling_name', '?')} #{entry.get('collective_seq_id', '?')} of process group "
            f"{group_id}{name}, {entry.get('state', '?')} ({how}, per this rank's flight recorder)")


def timeout_deadline(entries: list[dict], *, default_timeout_s: Optional[float] = None) -> Optional[float]:
    """When (a ``time.time()``) the oldest collective of ``entries`` not completed times out; ``None`` if none is
    pending or its creation time is unknown.

    Only for a recorder that marks completion (NCCL's): the others list finished collectives as pending. The
    timeout is the entry's own (``timeout_ms``: its process group's); ``default_timeout_s`` where it has none.
    """
    pending = next((e for e in entries if e.get("state") != "completed"), None)
    if pending is None or not pending.get("time_created_ns"):
        return None
    timeout_ms = pending.get("timeout_ms")
    if timeout_ms:
        timeout_s = float(timeout_ms) / 1000.0
    elif default_timeout_s is not None:
        timeout_s = float(default_timeout_s)
    else:
        return None
    return float(pending["time_created_ns"]) / 1e9 + timeout_s


def collective_deadline(*, default_timeout_s: Optional[float] = None) -> Optional[float]:
    """When NCCL's watchdog will time out the collective this process waits for (``timeout_deadline`` of its NCCL
    recorder), as a ``time.time()``; ``None`` when nothing is pending or there is no recorder. Never raises."""
    # only the collectives not completed: a few entries, not the whole buffer
    entries = _entries(True, only_active=True, nccl_only=True)
    if not entries:
        return None
    try:
        return timeout_deadline(entries, default_timeout_s=default_timeout_s)
    except (TypeError, ValueError):
        return None


def dump_flight_recorder(prefix: str, rank: int, *, nccl: bool) -> Optional[str]:
    """Write this rank's flight recorder buffer to ``<prefix><rank>``; ``None`` if this build has no recorder."""
    dump = _dump_function(nccl)
    if dump is None:
        return None
    data = dump(True, True, False)  # collectives, stack traces, completed ones too
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    path = f"{prefix}{rank}"
    with open(path, "wb") as f:
        f.write(data)
    return path


def read_command(prefix: str) -> str:
    """How to read the dumps of every rank at ``prefix``: torch's analyser, then the raw pickle."""
    folder, stem = os.path.split(prefix)
    return (f"python -m torch.distributed.flight_recorder.fr_trace {folder or '.'} --prefix {stem} "
            f"(add -j to list every rank's entries; --allow-incomplete-ranks if some ranks wrote none), "
            f"or in Python: pickle.load(open('{prefix}<rank>', 'rb'))['entries']")
