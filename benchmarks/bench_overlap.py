"""Can a tensor-parallel collective hide under a matmul on two GPUs? NCCL against copy-engine copies.

    python benchmarks/bench_overlap.py --out DIR     # 2 GPUs, ~1 min

tp2's forward collectives are exposed: each all-gather must finish before the matmul that reads
it. Splitting the batch in two (one half's collectives under the other half's matmuls) hides
little, because NCCL's kernels and cuBLAS's share the SMs: an overlapped NCCL kernel runs slower.
On two GPUs an all-gather is one copy of each rank's shard into its peer's buffer, and a
reduce-scatter is one copy of the half the peer owns plus a local add; over symmetric memory those
copies run on the copy engines, off the SMs. This measures, for the gpt-1.3b tp2 message size
(bf16, 16 x 2048 tokens x 2048), per rank:

- a run of matmuls alone (the block's matmul shapes);
- all-gather and reduce-scatter alone: NCCL, and copy-engine copies + device barriers;
- each collective on a side stream while the matmuls run: the wall time of the pair, the ideal
  (the longer of the two alone) and the serial sum;
- that the copy-engine results equal NCCL's.
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
from _launch import launch, read_ranks  # noqa: E402


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


def _worker(rank: int, world: int, port: int, args: dict, out_file: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    peer = 1 - rank
    tokens, d = args["tokens"], args["hidden"]
    dtype = torch.bfloat16
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

    # collectives on the residual stream: full (tokens, d), each rank's shard tokens / 2 rows
    shard = torch.randn(tokens // 2, d, device=device, dtype=dtype) * (rank + 1)
    full_nccl = torch.empty(tokens, d, device=device, dtype=dtype)
    partial = torch.randn(tokens, d, device=device, dtype=dtype) * (rank + 1)  # a row-parallel output
    rs_nccl = torch.empty(tokens // 2, d, device=device, dtype=dtype)

    def nccl_all_gather() -> None:
        dist.all_gather_into_tensor(full_nccl, shard, group=group)

    def nccl_reduce_scatter() -> None:
        dist.reduce_scatter_tensor(rs_nccl, partial, group=group)

    ce = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with contextlib.suppress(Exception):  # newer torch: deprecated, every group is enabled
                enable(group.group_name)
        gathered = symm_mem.empty((tokens, d), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(gathered, group.group_name)
        inbox = symm_mem.empty((tokens // 2, d), dtype=dtype, device=device)
        inbox_handle = symm_mem.rendezvous(inbox, group.group_name)
        rows = tokens // 2
        peer_gathered = handle.get_buffer(peer, (tokens, d), dtype)
        peer_inbox = inbox_handle.get_buffer(peer, (rows, d), dtype)
        rs_ce = torch.empty(rows, d, device=device, dtype=dtype)

        def ce_all_gather() -> None:
            handle.barrier(channel=0)  # the peer is done reading what the last gather left
            gathered[rank * rows:(rank + 1) * rows].copy_(shard)
            peer_gathered[rank * rows:(rank + 1) * rows].copy_(shard)  # a copy-engine put over NVLink
            handle.barrier(channel=1)  # both puts landed

        def ce_reduce_scatter() -> None:
            inbox_handle.barrier(channel=0)
            peer_inbox.copy_(partial[peer * rows:(peer + 1) * rows])  # the half the peer owns
            inbox_handle.barrier(channel=1)
            torch.add(partial[rank * rows:(rank + 1) * rows], inbox, out=rs_ce)

        ce = {"all_gather": ce_all_gather, "reduce_scatter": ce_reduce_scatter}
        nccl_all_gather(), nccl_reduce_scatter(), ce_all_gather(), ce_reduce_scatter()
        torch.cuda.synchronize()
        result["ce_all_gather_equal"] = bool(torch.equal(gathered, full_nccl))
        result["ce_reduce_scatter_max_abs_diff"] = float((rs_ce.float() - rs_nccl.float()).abs().max())
    except Exception as err:  # keep the NCCL rows
        result["errors"]["copy_engine"] = f"{type(err).__name__}: {err}"[:2000]
    # torch's own symmetric-memory collectives (workspace path: the input is a plain tensor)
    low = None
    try:
        symm_ops, group_name = torch.ops.symm_mem, group.group_name
        backend_stream = symm_mem._get_backend_stream()

        def wait(out: torch.Tensor) -> torch.Tensor:  # they copy on a stream of their own and return at once
            torch.cuda.current_stream().wait_stream(backend_stream)
            return out

        low = {"all_gather": lambda: wait(symm_ops._low_contention_all_gather(shard, group_name)),
               "reduce_scatter": lambda: wait(symm_ops._low_contention_reduce_scatter(partial, "sum", group_name))}
        ag, rs = low["all_gather"](), low["reduce_scatter"]()
        nccl_all_gather(), nccl_reduce_scatter()
        torch.cuda.synchronize()
        result["low_contention_all_gather_equal"] = bool(torch.equal(ag, full_nccl))
        result["low_contention_reduce_scatter_max_abs_diff"] = float((rs.float() - rs_nccl.float()).abs().max())
    except Exception as err:
        low = None
        result["errors"]["low_contention"] = f"{type(err).__name__}: {err}"[:2000]

    def sync() -> None:
        torch.cuda.synchronize()
        dist.barrier(group=group, device_ids=[rank])
        torch.cuda.synchronize()

    side = torch.cuda.Stream(device)

    def overlapped(comm: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(args["comm_rounds"]):
                    comm()
            matmuls()
            main.wait_stream(side)
        return run

    def repeated(comm: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args["comm_rounds"]):
                comm()
        return run

    reps = args["reps"]
    bytes_full = tokens * d * 2
    result["matmul_s"] = _time(matmuls, reps, sync)
    flops = args["matmul_rounds"] * 2 * tokens * d * (3 * d // 2 + d // 2 + 2 * d + 2 * d)
    result["matmul_tflops"] = flops / result["matmul_s"] / 1e12
    kinds = {"nccl": {"all_gather": nccl_all_gather, "reduce_scatter": nccl_reduce_scatter}}
    if ce is not None:
        kinds["copy_engine"] = ce
    if low is not None:
        kinds["torch_low_contention"] = low
    rows_out = []
    for impl, ops in kinds.items():
        for name, op in ops.items():
            try:
                alone = _time(repeated(op), reps, sync)
                both = _time(overlapped(op), reps, sync)
            except Exception as err:
                result["errors"][f"{impl}_{name}"] = f"{type(err).__name__}: {err}"[:2000]
                continue
            ideal = max(alone, result["matmul_s"])
            serial = alone + result["matmul_s"]
            rows_out.append({
                "impl": impl, "collective": name, "alone_s": alone,
                "bus_gbps_alone": args["comm_rounds"] * bytes_full * (world - 1) / world / alone / 1e9,
                "with_matmuls_s": both, "ideal_s": ideal, "serial_s": serial,
                # 1: the collective fully hidden; 0: no better than running one after the other
                "overlap_efficiency": (serial - both) / (serial - ideal) if serial > ideal else None,
            })
    result["rows"] = rows_out
    with open(out_file, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--tokens", type=int, default=16 * 2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--matmul-rounds", type=int, default=2)
    p.add_argument("--comm-rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=240.0)
    a = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        p.error("needs two CUDA GPUs")
    args = {"tokens": a.tokens, "hidden": a.hidden, "matmul_rounds": a.matmul_rounds, "comm_rounds": a.comm_rounds,
            "reps": a.reps}
    tmp = tempfile.mkdtemp()
    path = lambda r: os.path.join(tmp, f"rank{r}.json")  # noqa: E731
    error = launch(_rank_entry, (args, tmp), 2, a.timeout)
    ranks = read_ranks(path, 2)
    report = {"benchmark": "bench_overlap", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": args, "error": error,
              "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "CUDA_DEVICE_MAX"))},
              "ranks": ranks}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"bench_overlap_{stamp}.json").write_text(json.dumps(report, indent=1))
    if error:
        print("error:", error)
    for r in ranks:
        print(f"rank {r['rank']}: matmuls {1e3 * r['matmul_s']:.2f} ms ({r['matmul_tflops']:.0f} TFLOP/s); "
              f"CE gather equal {r.get('ce_all_gather_equal')}, CE reduce-scatter max diff "
              f"{r.get('ce_reduce_scatter_max_abs_diff')}; low-contention equal "
              f"{r.get('low_contention_all_gather_equal')}, diff {r.get('low_contention_reduce_scatter_max_abs_diff')}; "
              f"errors {r['errors']}")
        for row in r["rows"]:
            eff = row["overlap_efficiency"]
            print(f"  {row['impl']:20s} {row['collective']:15s} alone {1e3 * row['alone_s']:7.2f} ms "
                  f"({row['bus_gbps_alone']:5.0f} GB/s)  with matmuls {1e3 * row['with_matmuls_s']:7.2f} ms  "
                  f"ideal {1e3 * row['ideal_s']:7.2f}  serial {1e3 * row['serial_s']:7.2f}  "
                  f"overlap {'-' if eff is None else f'{eff:.2f}'}")
    print(f"wrote {out}/bench_overlap_{stamp}.json")


def _rank_entry(rank: int, world: int, port: int, args: dict, tmp: str) -> None:
    _worker(rank, world, port, args, os.path.join(tmp, f"rank{rank}.json"))


if __name__ == "__main__":
    main()
