"""All-gather and reduce-scatter bandwidth between the GPUs of one host, alone on the GPUs.

    python benchmarks/bench_nccl.py --out DIR [--tag NAME]     # 2 GPUs, ~15 s
    NCCL_PROTO=Simple python benchmarks/bench_nccl.py --tag simple

The TP and ZeRO benchmarks time their collectives inside training steps (bench_parallel3d's
``collectives``). This measures the same collectives (``all_gather_into_tensor`` /
``reduce_scatter_tensor``, bf16, the message sizes of a gpt-1.3b tp2 step and larger) with nothing
else running, so the two can be compared, and records the NCCL environment it ran under.
Bus bandwidth = bytes of the full tensor * (n-1)/n / s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import init_worker, launch  # noqa: E402

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


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tag", default="default")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    out_file = os.path.join(tempfile.mkdtemp(prefix="bench_nccl_"), "rows.json")
    error = launch(_worker, ({"smoke": a.smoke, "reps": 3 if a.smoke else a.reps}, out_file), a.gpus, 120)
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
