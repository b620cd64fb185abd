"""Interval maths for overlap: how much communication did compute hide?

Intervals are ``(start, end)`` pairs in any one time unit. A set of intervals is first
merged into its union (sorted, disjoint), then

    overlapped = |union(comm) & union(compute)|
    exposed    = |union(comm)| - overlapped

which is the time the step spends communicating with no compute running beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Interval", "union", "intersect", "total", "OverlapStats", "overlap_stats"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (touching intervals merge)."""
    items = sorted((float(s), float(e)) for s, e in intervals)
    for s, e in items:
        if e < s:
            raise ValueError(f"interval end {e} is before its start {s}")
    merged: list[Interval] = []
    for s, e in items:
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Intersection of two interval sets (each merged first); a two-pointer sweep."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ua) and j < len(ub):
        s = max(ua[i][0], ub[j][0])
        e = min(ua[i][1], ub[j][1])
        if s < e:
            out.append((s, e))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union."""
    return sum(e - s for s, e in union(intervals))


@dataclass(frozen=True, kw_only=True)
class OverlapStats:
    """Communication time split into the part compute hid and the exposed part."""

    comm: float
    compute: float
    overlapped: float
    exposed: float
    window: float

    @property
    def exposed_fraction(self) -> float:
        """Exposed communication as a fraction of the window (the step)."""
        return self.exposed / self.window if self.window > 0 else 0.0

    @property
    def overlap_fraction(self) -> float:
        """Share of the communication hidden behind compute."""
        return self.overlapped / self.comm if self.comm > 0 else 0.0


def overlap_stats(comm: Sequence[Interval], compute: Sequence[Interval], window: float | None = None) -> OverlapStats:
    """Overlap of ``comm`` with ``compute``; ``window`` defaults to the span of all intervals."""
    comm_u, comp_u = union(comm), union(compute)
    both = total(intersect(comm_u, comp_u))
    comm_t = total(comm_u)
    if window is None:
        everything = comm_u + comp_u
        window = (max(e for _, e in everything) - min(s for s, _ in everything)) if everything else 0.0
    return OverlapStats(comm=comm_t, compute=total(comp_u), overlapped=both, exposed=comm_t - both, window=window)
