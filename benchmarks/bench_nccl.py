"""All-gather and reduce-scatter between the GPUs of one host: their bandwidth alone, and whether they hide
under matmuls (``--part overlap``).

    python benchmarks/bench_nccl.py --out DIR [--tag NAME]     # 2 GPUs, ~15 s
    NCCL_PROTO=Simple python benchmarks/bench_nccl.py --tag simple
    python benchmarks/bench_nccl.py --part overlap --out DIR   # 2 GPUs, ~1 min
    python benchmarks/bench_nccl.py --smoke                    # bandwidth on 2 CPU processes (gloo)

``--part bandwidth`` (the default): the TP and ZeRO benchmarks time their collectives inside training
steps (bench_parallel3d's ``collectives``). This measures the same collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``, bf16, the message sizes of a gpt-1.3b tp2
step and larger) with nothing else running, so the two can be compared, and records the NCCL
environment it ran under. Bus bandwidth = bytes of the full tensor * (n-1)/n / s.

``--part overlap`` (two GPUs): tp2's forward collectives are exposed, each all-gather finishing before
the matmul that reads it; splitting the batch (one half's collectives under the other half's
matmuls) hides little when NCCL's kernels and cuBLAS's share the SMs. At the gpt-1.3b tp2 message
size (bf16, ``--tokens`` x ``--hidden`` on the residual stream), per rank: the block's matmul
shapes alone; the all-gather and reduce-scatter alone, by NCCL and by torch's symmetric-memory
collectives (``torch.ops.symm_mem._low_contention_*``: copy-engine copies, off the SMs; their
results checked against NCCL's); each collective on a side stream while the matmuls run: the
pair's time, the ideal (the longer of the two alone), the serial sum and the share of the
collective hidden (``overlap_efficiency``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import init_worker, launch, read_ranks  # noqa: E402

SIZES_MB = (16, 64, 128, 256, 512)


def _worker(rank: int, world: int, port: int, args: dict, out_file: str) -> None:
    import torch.distributed as dist

    cuda = not args["smoke"]
    device, dtype = init_worker(rank, world, port, args["smoke"])
    rows: list[dict[str, Any]] = []
    for mb in (SIZES_MB if cuda else (1,)):
        full = torch.empty(mb * 2**20 // 2, dtype=dtype, device=device)
        shard = torch.ones(full.numel() // world, dtype=dtype, device=device)
        for kind in ("all_gather", "reduce_scatter"):
            def op():
                if kind == "all_gather":
                    dist.all_gather_into_tensor(full, shard)
                else:
                    dist.reduce_scatter_tensor(shard, full)
            for _ in range(3):
                op()
            times = []
            for _ in range(args["reps"]):
                if cuda:
                    torch.cuda.synchronize()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    op()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 1e3)
                else:
                    import time

                    t0 = time.perf_counter()
                    op()
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            nbytes = full.numel() * full.element_size()
            rows.append({"kind": kind, "MB": mb, "seconds": t, "algbw_GBps": nbytes / t / 1e9,
                         "busbw_GBps": nbytes * (world - 1) / world / t / 1e9})
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _time(fn: Callable[[], None], reps: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` (events on the current stream, ``sync`` between repetitions)."""
    times = []
    for i in range(reps + 2):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _overlap_worker(rank: int, world: int, port: int, args: dict, out_dir: str) -> None:
    """``--part overlap`` on one of two GPUs (module docstring); the rank's JSON into ``out_dir``."""
    import torch.distributed as dist

    device, dtype = init_worker(rank, world, port, smoke=False)
    group = dist.group.WORLD
    tokens, d = args["tokens"], args["hidden"]
    result: dict[str, Any] = {"rank": rank, "tokens": tokens, "hidden": d, "errors": {}}
    # the matmuls of one block's forward on one TP rank (q/k/v, proj, fc1, fc2 shards)
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    h = torch.randn(tokens, 2 * d, device=device, dtype=dtype)
    w_qkv = torch.randn(d, 3 * d // 2, device=device, dtype=dtype) * 0.02
    w_proj = torch.randn(d // 2, d, device=device, dtype=dtype) * 0.02
    w_fc1 = torch.randn(d, 2 * d, device=device, dtype=dtype) * 0.02
    w_fc2 = torch.randn(2 * d, d, device=device, dtype=dtype) * 0.02

    def matmuls() -> None:
        for _ in range(args["matmul_rounds"]):
            torch.mm(x, w_qkv)
            torch.mm(x[:, : d // 2], w_proj)
            torch.mm(x, w_fc1)
            torch.mm(h, w_fc2)

    # collectives on the residual stream: full (tokens, d), each rank's shard tokens / world rows
    shard = torch.randn(tokens // world, d, device=device, dtype=dtype) * (rank + 1)
    gathered = torch.empty(tokens, d, device=device, dtype=dtype)
    partial = torch.randn(tokens, d, device=device, dtype=dtype) * (rank + 1)  # a row-parallel output
    scattered = torch.empty(tokens // world, d, device=device, dtype=dtype)
    kinds: dict[str, dict[str, Callable[[], Any]]] = {"nccl": {
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(scattered, partial, group=group)}}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with contextlib.suppress(Exception):  # newer torch: deprecated, every group is enabled
                enable(group.group_name)
        symm_ops, name = torch.ops.symm_mem, group.group_name
        backend_stream = symm_mem._get_backend_stream()

        def wait(out: torch.Tensor) -> torch.Tensor:  # they copy on a stream of their own and return at once
            torch.cuda.current_stream().wait_stream(backend_stream)
            return out

        low = {"all_gather": lambda: wait(symm_ops._low_contention_all_gather(shard, name)),
               "reduce_scatter": lambda: wait(symm_ops._low_contention_reduce_scatter(partial, "sum", name))}
        ag, rs = low["all_gather"](), low["reduce_scatter"]()
        kinds["nccl"]["all_gather"](), kinds["nccl"]["reduce_scatter"]()
        torch.cuda.synchronize()
        result["symm_mem_all_gather_equal"] = bool(torch.equal(ag, gathered))
        result["symm_mem_reduce_scatter_max_abs_diff"] = float((rs.float() - scattered.float()).abs().max())
        kinds["symm_mem"] = low
    except Exception as err:  # keep the NCCL rows
        result["errors"]["symm_mem"] = f"{type(err).__name__}: {err}"[:2000]

    def sync() -> None:
        torch.cuda.synchronize()
        dist.barrier(group=group, device_ids=[rank])
        torch.cuda.synchronize()

    side = torch.cuda.Stream(device)

    def repeated(comm: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args["comm_rounds"]):
                comm()
        return run

    def overlapped(comm: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                repeated(comm)()
            matmuls()
            main.wait_stream(side)
        return run

    reps = args["reps"]
    result["matmul_s"] = _time(matmuls, reps, sync)
    flops = args["matmul_rounds"] * 2 * tokens * d * (3 * d // 2 + d // 2 + 2 * d + 2 * d)
    result["matmul_tflops"] = flops / result["matmul_s"] / 1e12
    result["rows"] = []
    for impl, ops in kinds.items():
        for collective, op in ops.items():
            try:
                alone, both = _time(repeated(op), reps, sync), _time(overlapped(op), reps, sync)
            except Exception as err:  # recorded; the other rows still run
                result["errors"][f"{impl}_{collective}"] = f"{type(err).__name__}: {err}"[:2000]
                continue
            ideal, serial = max(alone, result["matmul_s"]), alone + result["matmul_s"]
            result["rows"].append({
                "impl": impl, "collective": collective, "alone_s": alone,
                "bus_gbps_alone": args["comm_rounds"] * tokens * d * 2 * (world - 1) / world / alone / 1e9,
                "with_matmuls_s": both, "ideal_s": ideal, "serial_s": serial,
                # 1: the collective fully hidden; 0: no better than running one after the other
                "overlap_efficiency": (serial - both) / (serial - ideal) if serial > ideal else None,
            })
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def overlap(a: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
    """``--part overlap``: both ranks' results, and the launch's error (None when both finished)."""
    tmp = tempfile.mkdtemp(prefix="bench_nccl_overlap_")
    args = {"tokens": a.tokens, "hidden": a.hidden, "matmul_rounds": a.matmul_rounds, "comm_rounds": a.comm_rounds,
            "reps": a.reps}
    error = launch(_overlap_worker, (args, tmp), 2, a.timeout)
    ranks = read_ranks(lambda r: os.path.join(tmp, f"rank{r}.json"), 2)
    for r in ranks:
        print(f"rank {r['rank']}: matmuls {1e3 * r['matmul_s']:.2f} ms ({r['matmul_tflops']:.0f} TFLOP/s); "
              f"symm_mem gather equal {r.get('symm_mem_all_gather_equal')}, reduce-scatter max diff "
              f"{r.get('symm_mem_reduce_scatter_max_abs_diff')}; errors {r['errors']}")
        for row in r["rows"]:
            eff = row["overlap_efficiency"]
            print(f"  {row['impl']:10s} {row['collective']:15s} alone {1e3 * row['alone_s']:7.2f} ms "
                  f"({row['bus_gbps_alone']:5.0f} GB/s)  with matmuls {1e3 * row['with_matmuls_s']:7.2f} ms  "
                  f"ideal {1e3 * row['ideal_s']:7.2f}  serial {1e3 * row['serial_s']:7.2f}  "
                  f"overlap {'-' if eff is None else f'{eff:.2f}'}")
    return ranks, error


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--part", choices=("bandwidth", "overlap"), default="bandwidth")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--reps", type=int, default=None, help="default 20 (bandwidth), 10 (overlap)")
    p.add_argument("--tag", default="default")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokens", type=int, default=16 * 2048, help="overlap: rows of the residual stream")
    p.add_argument("--hidden", type=int, default=2048, help="overlap: its width")
    p.add_argument("--matmul-rounds", type=int, default=2, help="overlap: the block's matmuls, repeated")
    p.add_argument("--comm-rounds", type=int, default=4, help="overlap: collectives per timed call")
    p.add_argument("--timeout", type=float, default=None, help="seconds (default 120; overlap 240)")
    a = p.parse_args(argv)
    if a.part == "overlap":
        if a.smoke or torch.cuda.device_count() < 2:
            p.error("--part overlap needs two CUDA GPUs (copy engines, streams and NVLink); --smoke checks bandwidth")
        a.reps, a.timeout = a.reps or 10, a.timeout or 240.0
        ranks, error = overlap(a)
        report = {"benchmark": "bench_nccl", "part": "overlap", "tag": a.tag,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "args": {k: getattr(a, k) for k in ("tokens", "hidden", "matmul_rounds", "comm_rounds", "reps")},
                  "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))},
                  "error": error, "ranks": ranks}
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_nccl_overlap_{a.tag}.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}" + (f" (error: {error})" if error else ""))
        return 0 if not error else 1
    a.reps, a.timeout = a.reps or 20, a.timeout or 120.0
    out_file = os.path.join(tempfile.mkdtemp(prefix="bench_nccl_"), "rows.json")
    error = launch(_worker, ({"smoke": a.smoke, "reps": 3 if a.smoke else a.reps}, out_file), a.gpus, a.timeout)
    rows = json.load(open(out_file)) if os.path.exists(out_file) else []
    report = {
        "benchmark": "bench_nccl", "tag": a.tag,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else "cpu",
        "gpus": a.gpus, "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))},
        "error": error, "rows": rows,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_nccl_{a.tag}{'_smoke' if a.smoke else ''}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in rows:
        print(f"[{a.tag}] {r['kind']:15s} {r['MB']:5d} MB  {1e3 * r['seconds']:8.3f} ms  "
              f"bus {r['busbw_GBps']:7.1f} GB/s")
    print(f"wrote {path}" + (f" (error: {error})" if error else ""))
    return 0 if not error else 1


if __name__ == "__main__":
    sys.exit(main())
