"""Collectives in a profiler trace: exposed time, and bus bandwidth.

Bandwidths: ``algbw = S / t`` with S the collective's data size
(the full buffer: all-reduce's buffer, all-gather's output, reduce-scatter's input), and
``busbw = algbw * factor`` where factor is ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for
all-gather, reduce-scatter and all-to-all, and 1 for broadcast, reduce and send/recv.
Bus bandwidth is comparable with the link's bandwidth whatever the rank count.

The trace is Chrome-trace events (``torch.profiler`` ``export_chrome_trace`` JSON):
on GPU, NCCL kernels are the communication and all other kernels and memcpys the work
that can hide it; on CPU (gloo) the ``gloo:*`` annotations of the gloo threads are the
communication and the main thread's ``aten::`` ops the compute.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from lightning_perf.perf.intervals import OverlapStats, intersect, overlap_stats, total, union

__all__ = [
    "BUS_FACTORS",
    "LINKS",
    "bus_bandwidth",
    "expected_link",
    "CollectiveStats",
    "CommAnalysis",
    "StepBreakdown",
    "analyze_comm_trace",
    "step_breakdown",
    "collective_kind",
]

# kind -> factor(n)
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}

GB = 1e9
# Unidirectional bandwidth one GPU can push over the link, bytes/s.
LINKS = {
    "nvlink5": 900 * GB,  # B200
    "nvlink4": 450 * GB,  # H100 / H200 SXM
    "nvlink3": 300 * GB,  # A100 SXM
    "nvlink-bridge": 300 * GB,  # H100 NVL / H200 NVL pairs (NVLink4 bridge, 600 GB/s bidirectional)
    "infinity-fabric": 448 * GB,  # MI300X (7 x 64 GB/s)
    "pcie5": 64 * GB,
    "pcie4": 32 * GB,
    "infiniband-ndr": 50 * GB,  # 400 Gb/s per NIC
    "infiniband-hdr": 25 * GB,  # 200 Gb/s per NIC
}

_DEVICE_LINK = (
    ("B200", "nvlink5"), ("H200 SXM", "nvlink4"), ("H100 SXM", "nvlink4"), ("A100 SXM", "nvlink3"),
    ("NVL", "nvlink-bridge"), ("MI300X", "infinity-fabric"), ("H100 PCIe", "pcie5"),
)


def bus_bandwidth(kind: str, size_bytes: float, seconds: float, ranks: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s for one collective of ``size_bytes`` over ``ranks`` ranks."""
    if kind not in BUS_FACTORS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(BUS_FACTORS)}")
    if seconds <= 0 or ranks < 1:
        raise ValueError(f"seconds ({seconds}) must be > 0 and ranks ({ranks}) >= 1")
    algbw = size_bytes / seconds
    return algbw, algbw * BUS_FACTORS[kind](ranks)


def expected_link(device_key: Optional[str], *, multi_node: bool = False) -> tuple[str, float]:
    """``(link name, bytes/s)`` a collective should reach: InfiniBand across nodes, else the GPU's link."""
    if multi_node:
        return "infiniband-ndr", LINKS["infiniband-ndr"]
    for fragment, link in _DEVICE_LINK:
        if device_key and fragment in device_key:
            return link, LINKS[link]
    return "pcie4", LINKS["pcie4"]


_KIND_PATTERNS = (
    ("all_reduce", r"all_?reduce"),
    ("reduce_scatter", r"reduce_?scatter"),
    ("all_gather", r"all_?gather"),
    ("all_to_all", r"all_?to_?all|alltoall"),
    ("broadcast", r"broadcast"),
    ("send_recv", r"send|recv"),
    ("reduce", r"reduce"),
)


def collective_kind(name: str) -> Optional[str]:
    """Collective kind from an event or kernel name (``ncclDevKernel_AllReduce_Sum_bf16``, ``gloo:all_gather``)."""
    low = name.lower()
    for kind, pattern in _KIND_PATTERNS:
        if re.search(pattern, low):
            return kind
    return None


_ELEMENT_SIZES = (("double", 8), ("long", 8), ("int64", 8), ("bfloat16", 2), ("half", 2), ("float16", 2),
                  ("float8", 1), ("float", 4), ("int", 4), ("byte", 1), ("char", 1), ("bool", 1))


def _element_size(dtype: Any, default: int = 4) -> int:
    low = str(dtype).lower()
    for key, size in _ELEMENT_SIZES:
        if key in low:
            return size
    return default


def _numel(dims: Any) -> int:
    if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
        n = 1
        for d in dims:
            n *= d
        return n
    if isinstance(dims, list):
        return sum(_numel(d) for d in dims)
    return 0


@dataclass(kw_only=True)
class CollectiveStats:
    kind: str
    count: int = 0
    bytes: float = 0.0
    seconds: float = 0.0
    algbw: float = 0.0
    busbw: float = 0.0


@dataclass(kw_only=True)
class CommAnalysis:
    overlap: OverlapStats
    collectives: dict[str, CollectiveStats] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        o = self.overlap
        return {
            "comm_s": o.comm, "overlapped_s": o.overlapped, "exposed_s": o.exposed, "window_s": o.window,
            "exposed_fraction": o.exposed_fraction, "overlap_fraction": o.overlap_fraction,
            "collectives": {k: vars(v) for k, v in self.collectives.items()},
        }


def _size_of(meta: dict[str, Any], kind: str) -> float:
    """Bytes S of one collective from a ``record_param_comms`` or ``c10d::`` op's args."""
    args = meta.get("args", {})
    elem = _element_size(args.get("dtype", ""))
    if "In msg nelems" in args:
        n_in, n_out = args.get("In msg nelems", 0), args.get("Out msg nelems", 0)
        return float((n_out if kind == "all_gather" else n_in) * elem)
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    if not dims:
        return 0.0
    if kind in ("all_gather",) and len(dims) > 1 and types and types[0] != "TensorList":
        return float(_numel(dims[0]) * _element_size(types[0]))  # output buffer first
    first_type = types[0] if types else ""
    return float(_numel(dims[0]) * _element_size(first_type))


def _split_trace(events: Iterable[dict[str, Any]]) -> tuple[list[dict], list[dict], list[dict]]:
    """``(communication, compute, launch records)`` of a trace's complete events.

    GPU: NCCL kernels, the other kernels and memcpys / memsets, and the ``record_param_comms`` (else
    ``c10d::``) host records; CPU (gloo): the ``gloo:*`` annotations, the main thread's ``aten::`` ops
    and the ``c10d::`` ops."""
    events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if kernels:  # GPU trace
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = [e for e in kernels if "nccl" not in e["name"].lower()]
        metas = [e for e in events if e.get("name") == "record_param_comms"]
        if not metas:
            metas = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::")]
        return comm, compute, metas
    comm = [e for e in events if e["name"].startswith("gloo:")]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    tids: dict[Any, int] = defaultdict(int)
    for e in ops:
        tids[e.get("tid")] += 1
    main = max(tids, key=tids.get) if tids else None
    compute = [e for e in ops if e.get("tid") == main and e["name"].startswith("aten::")]
    metas = [e for e in ops if e["name"].startswith("c10d::")]
    return comm, compute, metas


def _intervals(events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """Chrome-trace events (``ts`` / ``dur`` in us) as intervals in seconds."""
    return [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events]


def analyze_comm_trace(events: Iterable[dict[str, Any]], *, ranks: int, window: Optional[float] = None) -> CommAnalysis:
    """Exposed communication and per-kind bus bandwidth from Chrome-trace events (``ts``/``dur`` in us)."""
    comm, compute, metas = _split_trace(events)
    stats = overlap_stats(_intervals(comm), _intervals(compute), window)

    # pair the i-th communication event of a kind with the i-th launch record of that kind
    meta_by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in sorted(metas, key=lambda e: e["ts"]):
        kind = collective_kind(str(m.get("args", {}).get("Collective name", "")) or m["name"])
        if kind:
            meta_by_kind[kind].append(m)
    per_kind: dict[str, CollectiveStats] = {}
    seen: dict[str, int] = defaultdict(int)
    for e in sorted(comm, key=lambda e: e["ts"]):
        kind = collective_kind(e["name"])
        if kind is None:
            continue
        s = per_kind.setdefault(kind, CollectiveStats(kind=kind))
        idx = seen[kind]
        seen[kind] += 1
        s.count += 1
        s.seconds += e["dur"] / 1e6
        if idx < len(meta_by_kind[kind]):
            s.bytes += _size_of(meta_by_kind[kind][idx], kind)
    for s in per_kind.values():
        if s.seconds > 0 and s.bytes > 0:
            s.algbw, s.busbw = bus_bandwidth(s.kind, s.bytes, s.seconds, ranks)
    return CommAnalysis(overlap=stats, collectives=per_kind)


@dataclass(frozen=True, kw_only=True)
class StepBreakdown:
    """Where one rank's step goes, in seconds; the four parts add up to ``step``.

    ``compute``: some compute kernel runs. ``exposed_p2p``: only point-to-point transfers run (a
    pipeline's send / recv; a recv posted before its sender is ready waits here, so a pipeline's bubble
    shows up mostly as exposed P2P). ``exposed_collectives``: only other collectives run (all-gathers,
    reduce-scatters, all-reduces, broadcasts). ``idle``: nothing runs (the host is behind, or a wait the
    trace does not show as a kernel).
    """

    step: float
    compute: float
    exposed_p2p: float
    exposed_collectives: float
    idle: float

    def shares(self) -> dict[str, float]:
        """Each part as a share of the step."""
        parts = ("compute", "exposed_p2p", "exposed_collectives", "idle")
        return {k: (getattr(self, k) / self.step if self.step > 0 else 0.0) for k in parts}

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.step, "compute_s": self.compute, "exposed_p2p_s": self.exposed_p2p,
                "exposed_collectives_s": self.exposed_collectives, "idle_s": self.idle,
                **{f"{k}_pct": 100.0 * v for k, v in self.shares().items()}}


def step_breakdown(events: Iterable[dict[str, Any]], *, step_s: Optional[float] = None) -> StepBreakdown:
    """Split one profiled step (Chrome-trace events of one rank) into compute, exposed P2P, exposed
    collectives and idle time (:class:`StepBreakdown`).

    ``step_s``: the step's length, e.g. the measured mean step (default: the span of the trace's
    communication and compute); the idle part is what is left of it, never below zero. Point-to-point
    and collective time that overlaps compute counts as compute; P2P overlapping a collective counts as
    P2P.
    """
    comm, compute, _ = _split_trace(events)
    p2p = [e for e in comm if collective_kind(e["name"]) == "send_recv"]
    other = [e for e in comm if collective_kind(e["name"]) != "send_recv"]
    busy = union(_intervals(compute))
    p2p_u = union(_intervals(p2p))
    p2p_exposed = total(p2p_u) - total(intersect(p2p_u, busy))
    covered = union(busy + p2p_u)
    other_u = union(_intervals(other))
    other_exposed = total(other_u) - total(intersect(other_u, covered))
    everything = union(covered + other_u)
    if step_s is None:
        step_s = (everything[-1][1] - everything[0][0]) if everything else 0.0
    used = total(busy) + p2p_exposed + other_exposed
    return StepBreakdown(step=step_s, compute=total(busy), exposed_p2p=p2p_exposed,
                         exposed_collectives=other_exposed, idle=max(0.0, step_s - used))
