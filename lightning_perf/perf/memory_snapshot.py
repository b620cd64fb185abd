"""Where the memory of a CUDA memory snapshot was allocated: bytes per allocation site.

A snapshot is the dictionary ``torch.cuda.memory._snapshot()`` returns (and
``torch.cuda.memory._dump_snapshot`` pickles): ``segments``, each with ``blocks`` of
``size``, ``state`` and, when allocation history was recorded, ``frames`` (innermost
first); and ``device_traces``, one list of alloc / free events per device.

The site of an allocation is its innermost frame outside the torch package (the line of
the model or training code that asked for the memory); the innermost torch frame is kept
beside it as ``via`` (``torch/nn/modules/linear.py:125 forward``). An allocation with no
frames was made while history was not being recorded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

__all__ = ["Site", "is_library_frame", "site_of", "top_sites", "block_allocations", "trace_peak_allocations",
           "oom_event", "sites_markdown", "NO_STACK"]

NO_STACK = "(no stack: allocated while history was not recorded)"
_GB = 1e9


def is_library_frame(filename: str) -> bool:
    """A frame of torch itself (Python or C++), of generated code, or of the interpreter."""
    f = filename.replace("\\", "/")
    return (not f.endswith(".py") or f.startswith("<") or "/torch/" in f or f.startswith("torch/")
            or "torchinductor" in f)


def _short(filename: str) -> str:
    f = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in f:
            return f.split(marker, 1)[1]
    return f


def _frame(frame: Mapping[str, Any]) -> str:
    return f"{_short(str(frame.get('filename', '?')))}:{frame.get('line', '?')} {frame.get('name', '?')}"


def site_of(frames: Sequence[Mapping[str, Any]],
            is_library: Callable[[str], bool] = is_library_frame) -> tuple[str, Optional[str]]:
    """``(site, via)``: the innermost frame outside the library, and the innermost library frame
    with a Python file (``None`` when there is none)."""
    if not frames:
        return NO_STACK, None
    via = next((_frame(f) for f in frames
                if is_library(str(f.get("filename", ""))) and str(f.get("filename", "")).endswith(".py")), None)
    for f in frames:
        if not is_library(str(f.get("filename", ""))):
            return _frame(f), via
    return "(torch frames only)", via


@dataclass(kw_only=True)
class Site:
    site: str
    via: Optional[str]
    bytes: int
    allocations: int

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gb": self.bytes / _GB}


def block_allocations(snapshot: Mapping[str, Any], *, states: tuple[str, ...] = ("active_allocated",)
                      ) -> list[tuple[int, Sequence[Mapping[str, Any]]]]:
    """``(size, frames)`` of every block in ``states`` (live tensors by default)."""
    out = []
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") not in states:
                continue
            frames = block.get("frames")
            if frames is None and block.get("history"):  # older snapshot format
                frames = block["history"][0].get("frames", [])
            out.append((int(block.get("size", 0)), frames or []))
    return out


def trace_peak_allocations(snapshot: Mapping[str, Any], *, device: int = 0
                           ) -> tuple[int, list[tuple[int, Sequence[Mapping[str, Any]]]]]:
    """Replay the device's alloc / free events: ``(bytes, [(size, frames), ...])`` live at the moment
    the memory allocated during the recording peaked (memory allocated before the recording began,
    such as the parameters, is not in the trace and not counted)."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []

    def replay(stop: Optional[int]) -> tuple[int, int, dict[Any, Mapping[str, Any]]]:
        live: dict[Any, Mapping[str, Any]] = {}
        current = best = best_at = 0
        for i, e in enumerate(events):
            if stop is not None and i > stop:
                break
            action = e.get("action")
            if action == "alloc":
                live[e.get("addr")] = e
                current += int(e.get("size", 0))
            elif action == "free_completed" and e.get("addr") in live:
                current -= int(live.pop(e.get("addr")).get("size", 0))
            if current > best:
                best, best_at = current, i
        return best, best_at, live

    best, best_at, _ = replay(None)
    if best == 0:
        return 0, []
    _, _, live = replay(best_at)
    return best, [(int(e.get("size", 0)), e.get("frames") or []) for e in live.values()]


def oom_event(snapshot: Mapping[str, Any]) -> Optional[dict[str, int]]:
    """The last out-of-memory event of any device trace: ``{"size": requested, "device_free": bytes}``."""
    found = None
    for trace in snapshot.get("device_traces") or []:
        for e in trace:
            if e.get("action") == "oom":
                found = {"size": int(e.get("size", 0)), "device_free": int(e.get("device_free", 0))}
    return found


def top_sites(allocations: Iterable[tuple[int, Sequence[Mapping[str, Any]]]], *, top: int = 10,
              is_library: Callable[[str], bool] = is_library_frame) -> list[Site]:
    """Allocations summed per ``(site, via)``, largest first, the first ``top``."""
    sums: dict[tuple[str, Optional[str]], list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in allocations:
        key = site_of(frames, is_library)
        sums[key][0] += size
        sums[key][1] += 1
    ranked = sorted(sums.items(), key=lambda kv: (-kv[1][0], kv[0][0]))
    return [Site(site=s, via=v, bytes=b, allocations=n) for (s, v), (b, n) in ranked[:top]]


def sites_markdown(sites: Sequence[Site], *, title: str, total: Optional[int] = None) -> str:
    lines = [f"## {title}", ""]
    if total is not None:
        lines += [f"{total / _GB:.3g} GB in all; the largest sites:", ""]
    lines += ["| GB | allocations | site | via |", "| --- | --- | --- | --- |"]
    lines += [f"| {s.bytes / _GB:.3g} | {s.allocations} | {s.site} | {s.via or ''} |" for s in sites]
    return "\n".join(lines) + "\n"
