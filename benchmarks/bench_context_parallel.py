"""Context parallelism on the same GPUs: ring attention against the all-gather, and cp against dp.

    python benchmarks/bench_context_parallel.py --out benchmarks/results            # 2 GPUs, T 16k and 32k
    python benchmarks/bench_context_parallel.py --seq-lens 16384 --only attention   # the op alone
    python benchmarks/bench_context_parallel.py --only model --seq-lens 32768       # cp vs dp alone
    python benchmarks/bench_context_parallel.py --smoke                             # CPU, gloo, tiny

Each sequence is shared by ``--gpus`` cp ranks (the load-balanced chunks of
``parallel.model_parallel.context_parallel``). For every T it times:

- ``attention`` (``allgather`` and ``ring``): the cp attention op alone, forward + backward,
  q (1, 16, T/cp, 128) and GQA k / v (1, 8, T/cp, 128) per rank, bf16; its output and gradients
  compared on the first call with full causal SDPA of the whole sequence on each GPU (max relative
  error);
- ``model``: a forward + backward of a Llama-style GPT (``--layers`` blocks, default 24: 1.3B
  parameters; d 2048, 16 heads, 8 kv heads, rotary positions, bf16 weights), gradients averaged over the GPUs by DDP, with the
  same tokens per step (``gpus * T``) in three layouts: ``allgather`` and ``ring`` (cp over every
  GPU, ``gpus`` sequences each shared by all of them, as
  ``Parallel3DStrategy(context_parallel_size=cp, context_parallel_mode=...)`` wires it; no
  activation checkpointing) and ``dp`` (one whole sequence per GPU with full activation
  checkpointing per block, what a user without cp runs at this length). Tokens/s counts every
  GPU's tokens; on a GPU one more step runs under the profiler on rank 0 and ``gpu_time`` says
  where it went (matmuls, attention, communication, idle: ``perf.gpu_time``).

Times are wall clock per step (barrier, then synchronised), mean / median / p90 over ``--reps``
after ``--warmup`` steps (the first ring call autotunes the Triton blocks). Peak memory is rank 0's.
Each (what, T, mode) runs in a fresh process group with a deadline; a failure (an out-of-memory
dp leg, say) is recorded with its error and the run goes on. The JSON
(``bench_context_parallel_<gpus>x<device>_<date>.json`` under ``--out``) is rewritten after every
variant; ``ratios`` holds ring / all-gather time per (what, T) and, per T and cp mode, cp tokens/s
and peak memory over dp's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, installed or not
from _launch import init_worker, launch  # noqa: E402
from _timing import gpu_time_of  # noqa: E402

MODES = ("allgather", "ring")
MODEL_MODES = (*MODES, "dp")


def _shapes(args: dict) -> dict:
    if args["smoke"]:
        return dict(nh=4, nkv=2, hd=16, d=64, ffn=128, vocab=256)
    return dict(nh=16, nkv=8, hd=128, d=2048, ffn=5632, vocab=50304)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _time_steps(step, args: dict, cuda: bool) -> list[float]:
    import torch.distributed as dist

    for _ in range(args["warmup"]):
        step()
    times = []
    for _ in range(args["reps"]):
        dist.barrier()
        _sync(cuda)
        t0 = time.perf_counter()
        step()
        _sync(cuda)
        times.append(time.perf_counter() - t0)
    return times


def _attention(rank: int, world: int, args: dict, mode: str, T: int, device, dtype, cuda: bool) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_perf.parallel.model_parallel.context_parallel import context_parallel_attention, split_sequence
    from lightning_perf.parallel.model_parallel.ring_attention import ring_attention

    s = _shapes(args)
    gen = torch.Generator(device=device).manual_seed(0)  # the same whole sequence on every rank
    q, k, v = (torch.randn(1, n, T, s["hd"], generator=gen, device=device, dtype=dtype) for n in (s["nh"], s["nkv"],
                                                                                                  s["nkv"]))
    dy = torch.randn(1, s["nh"], T, s["hd"], generator=gen, device=device, dtype=dtype)
    fn = ring_attention if mode == "ring" else context_parallel_attention
    group = dist.group.WORLD
    local = [split_sequence(t, world, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    dy_local = split_sequence(dy, world, rank, dim=2)

    def step():
        for t in local:
            t.grad = None
        fn(*local, group=group).backward(dy_local)

    # correctness first: the whole sequence's causal attention on this GPU, cut to this rank's chunks
    full = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dy)
    y = fn(*local, group=group)
    y.backward(dy_local)
    want = [split_sequence(t, world, rank, dim=2) for t in (ref.detach(), full[0].grad, full[1].grad, full[2].grad)]
    errs = {name: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
            for name, a, b in zip(("out", "dq", "dk", "dv"), [y.detach()] + [t.grad for t in local], want)}
    del full, ref, want, y
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = _time_steps(step, args, cuda)
    return {"times": times, "rel_err": errs}


def _model(rank: int, world: int, args: dict, mode: str, T: int, device, dtype, cuda: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing
    from lightning_perf.parallel.model_parallel.context_parallel import apply_context_parallel

    s = _shapes(args)
    torch.manual_seed(0)
    cfg = GPTConfig(name="cp-bench", vocab_size=s["vocab"], block_size=T, n_layer=args["layers"], n_head=s["nh"],
                    n_kv_head=s["nkv"], n_embd=s["d"], intermediate_size=s["ffn"], bias=False, positions="rope",
                    norm="rmsnorm", activation="swiglu", tie_embeddings=False)
    model = GPT(cfg).to(device=device, dtype=dtype)
    if mode == "dp":  # one whole sequence per GPU: only each block's input is kept
        apply_activation_checkpointing(list(model.blocks.values()), "full")
        gen = torch.Generator(device=device).manual_seed(1 + rank)
        idx = torch.randint(0, s["vocab"], (1, T + 1), generator=gen, device=device)
    else:  # the same ``world`` sequences on every rank, each cut over all of them
        apply_context_parallel(model, init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))["cp"], mode)
        gen = torch.Generator(device=device).manual_seed(1)
        idx = torch.randint(0, s["vocab"], (world, T + 1), generator=gen, device=device)
    x, t = idx[:, :-1], idx[:, 1:]
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)

    def step():
        ddp.zero_grad(set_to_none=True)
        ddp(x, t).backward()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = _time_steps(step, args, cuda)
    row = {"times": times, "tokens_per_step": world * T, "tokens_per_s": world * T / statistics.mean(times),
           "activation_checkpointing": "full" if mode == "dp" else "none"}
    if cuda and rank == 0:  # one more step on every rank, profiled on rank 0
        row["gpu_time"] = gpu_time_of(step, top=15)
    elif cuda:
        step()
    return row


def _worker(rank: int, world: int, port: int, args: dict, variant: tuple, out_file: str) -> None:
    import torch.distributed as dist

    cuda = not args["smoke"]
    device, dtype = init_worker(rank, world, port, args["smoke"])
    what, T, mode = variant
    run = _attention if what == "attention" else _model
    row = run(rank, world, args, mode, T, device, dtype, cuda)
    times = row.pop("times")
    row.update(what=what, T=T, mode=mode, cp=world, mean_s=statistics.mean(times), median_s=statistics.median(times),
               p90_s=sorted(times)[int(0.9 * (len(times) - 1))], steps=len(times),
               peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None)
    if rank == 0:
        Path(out_file).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def _ratios(rows: list[dict], what: str, T: int) -> dict[str, float]:
    """ring / all-gather mean time; for the model, each cp mode's tokens/s and peak memory over dp's."""
    done = {r["mode"]: r for r in rows if r["what"] == what and r["T"] == T and "mean_s" in r}
    out = {}
    if "ring" in done and "allgather" in done:
        out[f"{what}_T{T}_ring_over_allgather"] = done["ring"]["mean_s"] / done["allgather"]["mean_s"]
    if "dp" not in done:
        return out
    for mode in (m for m in MODES if m in done):
        out[f"model_T{T}_{mode}_tokens_per_s_over_dp"] = done[mode]["tokens_per_s"] / done["dp"]["tokens_per_s"]
        if done[mode].get("peak_mem_gb") and done["dp"].get("peak_mem_gb"):
            out[f"model_T{T}_{mode}_peak_mem_over_dp"] = done[mode]["peak_mem_gb"] / done["dp"]["peak_mem_gb"]
    return out


def _device_tag(smoke: bool) -> str:
    if smoke or not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name(0).split()
    name = words[1] if len(words) > 1 and words[0].upper() == "NVIDIA" else words[0]
    return name.lower()


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--seq-lens", default="16384,32768")
    p.add_argument("--only", choices=("attention", "model"), default=None)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per variant")
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.seq_lens, a.layers, a.warmup, a.reps, a.timeout = "64", 1, 1, 2, 120.0
    args = {"smoke": a.smoke, "layers": a.layers, "warmup": a.warmup, "reps": a.reps}
    whats = [a.only] if a.only else ["attention", "model"]
    seq_lens = [int(t) for t in a.seq_lens.split(",")]
    date = dt.datetime.now(dt.timezone.utc)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = _device_tag(a.smoke)
    path = out / f"bench_context_parallel_{a.gpus}x{tag}_{date:%Y%m%d}{a.tag}{'_smoke' if a.smoke else ''}.json"
    report: dict[str, Any] = {
        "benchmark": "bench_context_parallel", "date": date.isoformat(), "gpus": a.gpus,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else "cpu",
        "torch": torch.__version__, "args": vars(a), "shapes": _shapes(args), "rows": [], "ratios": {},
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    tmp = Path(tempfile.mkdtemp(prefix="bench_cp_"))
    for what in whats:
        for T in seq_lens:
            for mode in (MODES if what == "attention" else MODEL_MODES):
                out_file = tmp / f"{what}_{T}_{mode}.json"
                error = launch(_worker, (args, (what, T, mode), str(out_file)), a.gpus, a.timeout)
                row = json.loads(out_file.read_text()) if out_file.exists() else {"what": what, "T": T, "mode": mode}
                row["error"] = error
                report["rows"].append(row)
                report["ratios"].update(_ratios(report["rows"], what, T))
                path.write_text(json.dumps(report, indent=2))
                msg = (f"{what:9s} T={T:6d} {mode:9s} mean {1e3 * row['mean_s']:9.2f} ms  median "
                       f"{1e3 * row['median_s']:9.2f} ms" if "mean_s" in row else f"{what} T={T} {mode}: {error}")
                if row.get("tokens_per_s"):
                    msg += f"  {row['tokens_per_s']:10.0f} tokens/s"
                if row.get("peak_mem_gb") is not None:
                    msg += f"  peak {row['peak_mem_gb']:.1f} GB"
                if row.get("rel_err"):
                    msg += "  rel err " + " ".join(f"{k} {v:.1e}" for k, v in row["rel_err"].items())
                print(msg, flush=True)
    print(json.dumps(report["ratios"], indent=2))
    print(f"wrote {path}")
    return 0 if all(r.get("error") is None for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
