"""Context parallelism on the same GPUs: ring attention against the all-gather, cp against dp, and
llama-8b at a 128k-token sequence.

    python benchmarks/bench_context_parallel.py --out benchmarks/results            # 2 GPUs, T 16k and 32k
    python benchmarks/bench_context_parallel.py --seq-lens 16384 --only attention   # the op alone
    python benchmarks/bench_context_parallel.py --only model --seq-lens 32768 \
        --model-modes ring_selective,dp                                            # cp2 ring + selective vs dp2 + full
    python benchmarks/bench_context_parallel.py --model llama-8b --gpus 4 \
        --model-modes ring_full                                                    # llama-8b, T 131072, cp4, ZeRO-3
    python benchmarks/bench_context_parallel.py --smoke                             # CPU, gloo, tiny
    python benchmarks/bench_context_parallel.py --smoke --model llama-8b            # the llama-8b wiring, tiny, 4 modes

Each sequence is shared by ``--gpus`` cp ranks (the load-balanced chunks of
``parallel.model_parallel.context_parallel``). For every T it times:

- ``attention`` (``allgather`` and ``ring``): the cp attention op alone, forward + backward,
  q (1, nh, T/cp, 128) and GQA k / v (1, 8, T/cp, 128) per rank, bf16; its output and gradients
  compared on the first call with full causal SDPA of the whole sequence on each GPU (max relative
  error);
- ``model`` with ``--model gpt-1.3b`` (the default): a forward + backward of a Llama-style GPT
  (``--layers`` blocks, default 24: 1.3B parameters; d 2048, 16 heads, 8 kv heads, rotary
  positions, bf16 weights), gradients averaged over the GPUs by DDP, with the same tokens per step
  (``gpus * T``) in the layouts of ``--model-modes``, each ``<layout>[_<checkpointing>]``:

  - ``allgather``, ``ring``: cp over every GPU, ``gpus`` sequences each shared by all of them, as
    ``Parallel3DStrategy(context_parallel_size=cp, context_parallel_mode=...)`` wires it, no
    activation checkpointing;
  - ``allgather_selective``, ``ring_selective`` (``_full`` too): the same under selective activation
    checkpointing per block, which keeps the cp attention's output and LSE (ring) or its gathered
    K / V (all-gather) with the matmul outputs, so the recomputation runs no cp communication and
    no attention;
  - ``dp``: one whole sequence per GPU with full activation checkpointing per block (what a user
    without cp runs at this length); ``dp_selective``: the same under selective checkpointing
    (where it fits: it keeps every matmul output of the whole sequence).

  The default is all six; the comparison the cp work aims at is ``ring_selective`` against ``dp``
  at T 32k;
- ``model`` with ``--model llama-8b``: llama-8b's shapes (32 layers, d 4096, 32 heads, 8 kv heads,
  ffn 14336, vocab 128256; default T 131072) trained (forward, backward, AdamW step) with
  ``Parallel3DStrategy``'s own wiring (``parallelize_3d``): cp over ``--cp`` ranks (default every
  GPU) times dp over the rest, the model built on meta and materialised shard by shard, FSDP2 /
  ZeRO-3 over the flattened dp x cp ranks with bf16 compute and fp32 gradient reduction, the
  pack's Triton kernels (the fused linear + cross-entropy: no 32k x 128k logits), ``--fp8`` for
  FP8 tensorwise linears, ``--compile`` for per-block torch.compile. Modes as above with the
  checkpointing named (``ring_full`` the default, ``ring_selective``, ``allgather_full``, ``dp_full``:
  one sequence per GPU, ZeRO-3 over all of them).

  Memory per GPU at T 131072 on cp4 (8.03B parameters, 32k tokens per rank), by arithmetic:
  fp32 parameters, gradients and both Adam moments sharded four ways are 16 B x 8.03e9 / 4 =
  32.1 GB (29.9 GiB); the bf16 gather of one block (218M parameters) is 0.44 GB, about twice that
  with prefetch, plus the embedding and head (0.53B parameters each, 1.05 GB bf16 each) when
  gathered. Activations per block at 32768 tokens per rank (d 4096, bf16): its input, what full
  checkpointing keeps, is 32768 x 4096 x 2 B = 0.27 GB (256 MiB), 8 GiB over 32 blocks; selective
  checkpointing keeps the q / k / v, attention, o_proj, gate, up and down outputs (4096 + 2 x 1024
  + 4096 + 4096 + 2 x 14336 + 4096 = 47104 values a token) and the LSE (32 heads x 4 B), 3.09 GB
  (2.88 GiB) a block, 92 GiB over 32 blocks, plus the block inputs: about 130 GiB with the states,
  at or past an H200's memory before any transient buffer. So llama-8b at T 131072 on 4 GPUs runs
  ``ring_full`` (about 30 + 8 GiB kept, plus one block's recomputation at 32k tokens, about 6 GiB,
  and the ring's fp32 block buffers, 1-2 GiB); ``ring_selective`` fits with cp8 (half the
  activations, states sharded eight ways). ``dp_full`` holds 131072 tokens a GPU: 32 GiB of block
  inputs and a four times larger recomputation next to the same 30 GiB of states.

Times are wall clock per step (barrier, then synchronised), mean / median / p90 over ``--reps``
after ``--warmup`` steps (the first ring call autotunes the Triton blocks). Peak memory is rank 0's
(llama-8b: counted from after the warm-up steps, with the optimizer states allocated). Tokens/s
counts every GPU's tokens, and ``tokens_per_s_per_gpu`` divides by the GPUs; on a GPU one more
step runs under the profiler on rank 0 and ``gpu_time`` says where it went (matmuls, attention,
communication, idle: ``perf.gpu_time``; ``--no-profile`` skips it). Each (what, T, mode) runs in a
fresh process group with a deadline; a failure (an out-of-memory leg, say) is recorded with its
error and the run goes on. The JSON
(``bench_context_parallel_<gpus>x<device>_<date>.json`` under ``--out``) is rewritten after every
variant; ``ratios`` holds ring / all-gather time per (what, T) and, per T, every cp mode's tokens/s
and peak memory over each dp mode's (``model_T32768_ring_selective_tokens_per_s_over_dp``: cp2 ring
+ selective over dp2 + full).
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
LAYOUTS = (*MODES, "dp")
CHECKPOINTING = ("none", "selective", "full")
MODEL_MODES = ("allgather", "ring", "allgather_selective", "ring_selective", "dp", "dp_selective")
LLAMA8B_MODES = ("ring_full",)
LLAMA8B_SMOKE_MODES = ("ring_full", "ring_selective", "allgather_selective", "dp_full")  # the wiring of each
MODELS = ("gpt-1.3b", "llama-8b")


def parse_model_mode(mode: str) -> tuple[str, str]:
    """``"ring_selective"`` -> ("ring", "selective"); a bare cp layout runs without checkpointing,
    a bare ``"dp"`` with full checkpointing."""
    layout, _, ac = mode.partition("_")
    if layout not in LAYOUTS or (ac and ac not in CHECKPOINTING):
        raise ValueError(f"model mode {mode!r} is not <layout>[_<checkpointing>] with a layout of {LAYOUTS} and "
                         f"checkpointing of {CHECKPOINTING} (e.g. 'ring_selective', 'dp')")
    return layout, ac or ("full" if layout == "dp" else "none")


def _shapes(args: dict) -> dict:
    if args["smoke"]:
        return dict(nh=4, nkv=2, hd=16, d=64, ffn=128, vocab=256)
    if args["model"] == "llama-8b":
        return dict(nh=32, nkv=8, hd=128, d=4096, ffn=14336, vocab=128256)
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

    layout, ac = parse_model_mode(mode)
    s = _shapes(args)
    torch.manual_seed(0)
    cfg = GPTConfig(name="cp-bench", vocab_size=s["vocab"], block_size=T, n_layer=args["layers"], n_head=s["nh"],
                    n_kv_head=s["nkv"], n_embd=s["d"], intermediate_size=s["ffn"], bias=False, positions="rope",
                    norm="rmsnorm", activation="swiglu", tie_embeddings=False)
    model = GPT(cfg).to(device=device, dtype=dtype)
    apply_activation_checkpointing(list(model.blocks.values()), ac)  # before cp, as parallelize_3d orders them
    if layout == "dp":  # one whole sequence per GPU
        gen = torch.Generator(device=device).manual_seed(1 + rank)
        idx = torch.randint(0, s["vocab"], (1, T + 1), generator=gen, device=device)
    else:  # the same ``world`` sequences on every rank, each cut over all of them
        apply_context_parallel(model, init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))["cp"], layout)
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
           "tokens_per_s_per_gpu": T / statistics.mean(times), "layout": layout, "cp": 1 if layout == "dp" else world,
           "activation_checkpointing": ac}
    if cuda and args["profile"] and rank == 0:  # one more step on every rank, profiled on rank 0
        row["gpu_time"] = gpu_time_of(step, top=15)
    elif cuda and args["profile"]:
        step()
    return row


def _llama8b(rank: int, world: int, args: dict, mode: str, T: int, device, dtype, cuda: bool) -> dict:
    """llama-8b's shapes trained through ``parallelize_3d`` (Parallel3DStrategy's wiring): cp x dp, ZeRO-3."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig
    from lightning_perf.parallel.model_parallel.parallelize_3d import parallelize_3d
    from lightning_perf.parallel.sharding.optim import localize_optimizer

    layout, ac = parse_model_mode(mode)
    cp = 1 if layout == "dp" else (args["cp"] or world)
    s = _shapes(args)
    fp8 = {"fp8": "tensorwise", "fused_qkv": True} if args["fp8"] else {}
    if args["smoke"]:
        cfg = GPTConfig(name="llama-8b-smoke", vocab_size=s["vocab"], block_size=T, n_layer=args["layers"],
                        n_head=s["nh"], n_kv_head=s["nkv"], n_embd=s["d"], intermediate_size=s["ffn"], bias=False,
                        positions="rope", norm="rmsnorm", activation="swiglu", tie_embeddings=False, **fp8)
    else:  # the Triton kernels: the fused linear + cross-entropy never builds the (tokens, 128256) logits
        cfg = GPTConfig.from_name("llama-8b", block_size=T, n_layer=args["layers"], kernels="triton", **fp8)
    config = Parallel3DConfig(
        data_parallel_size=world // cp, context_parallel_size=cp,
        context_parallel_mode=layout if layout != "dp" else "allgather", zero_stage=3, activation_checkpointing=ac,
        compile="default" if args["compile"] else None, compile_backend="aot_eager" if args["smoke"] else "inductor")
    mesh = config.dims(world).build_mesh(device.type)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = cfg.num_params()
    parallelize_3d(model, config, mesh, device=device,
                   mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    localize_optimizer(opt)  # as the strategy does: Adam steps the local shards
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    gen = torch.Generator(device=device).manual_seed(1 + dp_rank)  # the cp ranks of one replica: one batch
    idx = torch.randint(0, cfg.vocab_size, (args["batch"], T + 1), generator=gen, device=device)
    x, t = idx[:, :-1], idx[:, 1:]
    losses: list[float] = []

    def step():
        loss = model(x, t)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(args["warmup"]):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = _time_steps(step, {**args, "warmup": 0}, cuda)
    tokens = dp * args["batch"] * T
    mean = statistics.mean(times)
    row = {"times": times, "model": "llama-8b", "params": n_params, "layout": layout, "cp": cp, "dp": dp,
           "activation_checkpointing": ac, "fp8": bool(args["fp8"]), "compile": bool(args["compile"]),
           "tokens_per_step": tokens, "tokens_per_s": tokens / mean, "tokens_per_s_per_gpu": tokens / mean / world,
           "model_tflops_per_gpu": cfg.flops_per_token(T) * tokens / mean / world / 1e12,
           "losses": [float(v) for v in losses]}
    if cuda:
        row["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    if cuda and args["profile"] and rank == 0:  # one more step on every rank, profiled on rank 0
        row["gpu_time"] = gpu_time_of(step, top=15)
    elif cuda and args["profile"]:
        step()
    return row


def _worker(rank: int, world: int, port: int, args: dict, variant: tuple, out_file: str) -> None:
    import torch.distributed as dist

    cuda = not args["smoke"]
    device, dtype = init_worker(rank, world, port, args["smoke"])
    what, T, mode = variant
    run = _attention if what == "attention" else _llama8b if args["model"] == "llama-8b" else _model
    row = run(rank, world, args, mode, T, device, dtype, cuda)
    times = row.pop("times")
    row.setdefault("cp", world)
    row.update(what=what, T=T, mode=mode, mean_s=statistics.mean(times), median_s=statistics.median(times),
               p90_s=sorted(times)[int(0.9 * (len(times) - 1))], steps=len(times),
               peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None)
    if rank == 0:
        Path(out_file).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def _ratios(rows: list[dict], what: str, T: int) -> dict[str, float]:
    """ring / all-gather mean time (without and with selective checkpointing); for the model, every cp
    mode's tokens/s and peak memory over every dp mode's."""
    done = {r["mode"]: r for r in rows if r["what"] == what and r["T"] == T and "mean_s" in r}
    out = {}
    for suffix in ("", "_selective", "_full"):
        ring, allgather = done.get("ring" + suffix), done.get("allgather" + suffix)
        if ring and allgather:
            out[f"{what}_T{T}_ring{suffix}_over_allgather{suffix}"] = ring["mean_s"] / allgather["mean_s"]
    if what != "model":
        return out
    bases = [m for m in done if parse_model_mode(m)[0] == "dp"]
    for base in bases:
        for mode in (m for m in done if parse_model_mode(m)[0] != "dp"):
            a, b = done[mode], done[base]
            out[f"model_T{T}_{mode}_tokens_per_s_over_{base}"] = a["tokens_per_s"] / b["tokens_per_s"]
            if a.get("peak_mem_gb") and b.get("peak_mem_gb"):
                out[f"model_T{T}_{mode}_peak_mem_over_{base}"] = a["peak_mem_gb"] / b["peak_mem_gb"]
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
    p.add_argument("--seq-lens", default=None, help="comma-separated (default 16384,32768; llama-8b 131072)")
    p.add_argument("--only", choices=("attention", "model"), default=None)
    p.add_argument("--model", choices=MODELS, default="gpt-1.3b",
                   help="gpt-1.3b: DDP, cp against dp; llama-8b: parallelize_3d with ZeRO-3 (default T 131072)")
    p.add_argument("--model-modes", default=None,
                   help=f"comma-separated <layout>[_<checkpointing>] (default {','.join(MODEL_MODES)}; llama-8b: "
                        f"{','.join(LLAMA8B_MODES)}, under --smoke {','.join(LLAMA8B_SMOKE_MODES)})")
    p.add_argument("--cp", type=int, default=None, help="llama-8b: cp ranks per sequence (default: every GPU)")
    p.add_argument("--batch", type=int, default=1, help="llama-8b: sequences per dp replica")
    p.add_argument("--fp8", action="store_true", help="llama-8b: FP8 tensorwise linears (torchao), fused q/k/v")
    p.add_argument("--compile", action="store_true", help="llama-8b: torch.compile per block")
    p.add_argument("--layers", type=int, default=None, help="blocks (default 24 for gpt-1.3b, 32 for llama-8b)")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (llama-8b: 2)")
    p.add_argument("--reps", type=int, default=None, help="default 10 (llama-8b: 3)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per variant (default 420; llama-8b 560)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the profiled step (and its gpu_time breakdown)")
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    llama = a.model == "llama-8b"
    if a.seq_lens is None:
        a.seq_lens = "131072" if llama else "16384,32768"
    a.layers = a.layers or (32 if llama else 24)
    a.warmup = a.warmup if a.warmup is not None else (2 if llama else 3)
    a.reps = a.reps or (3 if llama else 10)
    a.timeout = a.timeout or (560.0 if llama else 420.0)
    if a.smoke:
        a.seq_lens, a.layers, a.warmup, a.reps, a.timeout = "64", 2 if llama else 1, 1, 2, 180.0
    default_modes = (LLAMA8B_SMOKE_MODES if a.smoke else LLAMA8B_MODES) if llama else MODEL_MODES
    model_modes = a.model_modes.split(",") if a.model_modes else list(default_modes)
    seq_lens = [int(t) for t in a.seq_lens.split(",")]
    # bad input fails here, before any process starts
    for mode in model_modes:
        try:
            parse_model_mode(mode)
        except ValueError as e:
            p.error(str(e))
    if a.smoke and a.fp8:
        p.error("--fp8 needs a GPU (torchao's FP8 matmuls); leave it out of --smoke")
    if (a.fp8 or a.compile or a.cp or a.batch != 1) and not llama:
        p.error("--fp8, --compile, --cp and --batch belong to --model llama-8b")
    cp = a.cp or a.gpus
    if llama and (cp < 1 or a.gpus % cp):
        p.error(f"--cp {cp} must divide --gpus {a.gpus}")
    for T in seq_lens:
        if T % (2 * cp):
            p.error(f"T={T} must divide into 2 * cp = {2 * cp} chunks")
    args = {"smoke": a.smoke, "layers": a.layers, "warmup": a.warmup, "reps": a.reps, "model": a.model,
            "cp": a.cp, "batch": a.batch, "fp8": a.fp8, "compile": a.compile, "profile": a.profile}
    whats = [a.only] if a.only else (["model"] if llama else ["attention", "model"])
    date = dt.datetime.now(dt.timezone.utc)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = _device_tag(a.smoke)
    name = "bench_context_parallel" + ("_llama8b" if llama else "")
    path = out / f"{name}_{a.gpus}x{tag}_{date:%Y%m%d}{a.tag}{'_smoke' if a.smoke else ''}.json"
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
            for mode in (MODES if what == "attention" else model_modes):
                out_file = tmp / f"{what}_{T}_{mode}.json"
                error = launch(_worker, (args, (what, T, mode), str(out_file)), a.gpus, a.timeout)
                row = json.loads(out_file.read_text()) if out_file.exists() else {"what": what, "T": T, "mode": mode}
                row["error"] = error
                report["rows"].append(row)
                report["ratios"].update(_ratios(report["rows"], what, T))
                path.write_text(json.dumps(report, indent=2))
                msg = (f"{what:9s} T={T:6d} {mode:19s} mean {1e3 * row['mean_s']:9.2f} ms  median "
                       f"{1e3 * row['median_s']:9.2f} ms" if "mean_s" in row else f"{what} T={T} {mode}: {error}")
                if row.get("tokens_per_s"):
                    msg += f"  {row['tokens_per_s']:10.0f} tokens/s ({row['tokens_per_s_per_gpu']:.0f} a GPU)"
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
