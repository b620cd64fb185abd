"""AdamW's step on FSDP2-sharded parameters against the same shards held other ways (GPU).

    python benchmarks/bench_optimizer.py --out DIR            # gpt-1.3b shards on 2 GPUs, ~1 min
    python benchmarks/bench_optimizer.py --smoke              # tiny model, CPU processes (gloo)

AdamW over per-parameter DTensor shards can cost much more per step than over one flat parameter
(Lightning's FSDP) or over plain tensors of the same size: DTensor dispatch on the host, and many
small multi-tensor launches. This separates the causes:
every rank shards gpt-1.3b per block with ``fully_shard`` (as the ZeRO strategy does), gives
every parameter a gradient, then times ``optimizer.step()`` (CUDA events, median) for:

- ``dtensor_fused`` / ``dtensor_foreach``: AdamW over the sharded DTensor parameters;
- ``local_fused``: AdamW over plain tensors shaped like this rank's local shards;
- ``flat_fused``: AdamW over one flat tensor with as many elements (FSDP1's flat parameter).

Per variant: step ms (device), host ms to issue a step, and the kernels of one profiled step
(``lightning_perf.perf.gpu_time``: kernel milliseconds and launches). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import launch, read_ranks  # noqa: E402
from _timing import gpu_time_of  # noqa: E402


def _time_steps(opt: Any, steps: int, cuda: bool) -> dict[str, float]:
    for _ in range(3):
        opt.step()
    dev, host = [], []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t0)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            dev.append(start.elapsed_time(end))
        else:
            dev.append(1e3 * host[-1])
    return {"step_ms": statistics.median(dev), "host_ms": 1e3 * statistics.median(host)}


def _worker(rank: int, world: int, port: int, args: dict, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {}
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from lightning_perf.models.gpt import GPT, GPTConfig

        cuda = not args["smoke"]
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        config = GPTConfig.from_name(args["preset"])
        with torch.device("meta"):
            model = GPT(config)
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device=device)
        params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator(device=device).manual_seed(rank)
        with torch.no_grad():
            for p in params:
                local = p.to_local()
                local.normal_(0.0, 0.02, generator=gen)
                p.grad = torch.empty_like(p)
                p.grad.to_local().normal_(0.0, 1e-3, generator=gen)
        local_numel = sum(p.to_local().numel() for p in params)
        result.update(preset=config.name, world=world, params=len(params), local_numel=local_numel,
                      local_contiguous=all(p.to_local().is_contiguous() for p in params),
                      grads_contiguous=all(p.grad.to_local().is_contiguous() for p in params))
        variants: dict[str, Any] = {}

        def local_copies() -> list[torch.nn.Parameter]:
            out = []
            for p in params:
                q = torch.nn.Parameter(p.to_local().detach().clone())
                q.grad = p.grad.to_local().detach().clone()
                out.append(q)
            return out

        flat = torch.nn.Parameter(torch.zeros(local_numel, device=device))
        flat.grad = torch.randn(local_numel, device=device, generator=gen) * 1e-3
        builds = {
            "dtensor_fused": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True),
            "dtensor_foreach": lambda: torch.optim.AdamW(params, lr=1e-4, foreach=True),
            "local_fused": lambda: torch.optim.AdamW(local_copies(), lr=1e-4, fused=True),
            "flat_fused": lambda: torch.optim.AdamW([flat], lr=1e-4, fused=True),
        }
        for name, build in builds.items():
            try:
                opt = build()
                r = _time_steps(opt, args["steps"], cuda)
                r["kernels"] = gpu_time_of(opt.step, top=8)
                variants[name] = r
                del opt
                if cuda:
                    torch.cuda.empty_cache()
            except Exception as e:  # recorded; the other variants still run
                variants[name] = {"error": f"{type(e).__name__}: {e}"}
        result["variants"] = variants
        result["ok"] = True
        dist.destroy_process_group()
    except BaseException as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    with open(f"{out_file}.rank{rank}", "w") as f:
        json.dump(result, f)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--preset", default="gpt-1.3b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=240.0)
    a = parser.parse_args(argv)
    args = {"smoke": a.smoke, "preset": "tiny" if a.smoke else a.preset, "steps": 3 if a.smoke else a.steps}
    tmp = tempfile.mkdtemp(prefix="bench_optimizer_")
    out_file = os.path.join(tmp, "result")
    error = launch(_worker, (args, out_file), a.gpus, a.timeout)
    ranks = read_ranks(lambda r: f"{out_file}.rank{r}", a.gpus)
    report = {
        "benchmark": "bench_optimizer",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else "cpu",
        "torch": torch.__version__,
        "config": args,
        "error": error,
        "ranks": ranks,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"bench_optimizer{'_smoke' if a.smoke else ''}_{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in ranks[:1]:
        if not r.get("ok"):
            print("failed:", r.get("error"), r.get("traceback", "")[-1500:])
            continue
        print(f"{r['preset']}: {r['params']} parameters, {r['local_numel'] / 1e6:.0f}M elements on rank 0 "
              f"(local shards contiguous: {r['local_contiguous']}, grads: {r['grads_contiguous']})")
        for name, v in r["variants"].items():
            if "error" in v:
                print(f"  {name:16s} failed: {v['error'][:200]}")
                continue
            k = v["kernels"]
            print(f"  {name:16s} step {v['step_ms']:8.2f} ms  host {v['host_ms']:8.2f} ms  "
                  f"kernels {sum(k.get('ms_per_step', {}).values()):7.2f} ms")
            for kname, ms in list(k.get("top_kernels_ms_per_step", {}).items())[:4]:
                print(f"      {ms:7.2f} ms x{k['top_kernels_launches_per_step'][kname]:.0f}  {kname[:110]}")
    print(f"wrote {path}")
    return 0 if not error else 1


if __name__ == "__main__":
    sys.exit(main())
