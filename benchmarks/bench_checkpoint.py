"""How long does a sharded checkpoint stall training: synchronous save against ``AsyncCheckpointer``.

    python benchmarks/bench_checkpoint.py --out DIR                       # gpt2-124m + AdamW on one GPU, ~2 min, 3 GB of disk
    python benchmarks/bench_checkpoint.py --preset gpt-1.3b --seq-len 2048 --batch 4 --every 300 --saves 2
                                                                          # 15.8 GB per save: minutes on a slow disk
    python benchmarks/bench_checkpoint.py --smoke                         # tiny model on the CPU

One process, one device, a one-rank process group (NCCL on a GPU, gloo on the CPU) so the async
side runs exactly as under the strategies: its background collectives on a gloo group of their own.
The GPT trains with AdamW (bf16 autocast on a GPU); every ``--every`` steps the state is saved,
first with ``save_checkpoint`` (the baseline: the save call writes, checksums and renames), then in
a fresh run of the same model with ``AsyncCheckpointer.save``. Every step ends with a device
synchronise so each step's wall time is what the loop waited. Per side:

- ``step_ms``: median step without a save;
- ``stall_ms``: per save, the step that saved minus ``step_ms`` (for async: the staging copy);
- ``slowdown_ms``: async only, the steps run while the write was in flight, their extra time
  over ``step_ms`` summed (the write competing for the host, memory bandwidth and PCIe);
- ``final_s``: async only, from the save call until the checkpoint was final (polled each step);
- ``bytes``: the last checkpoint's size on disk (two at most are kept on disk at a time).

The JSON (``bench_checkpoint_<device>_<date>.json``) is rewritten after each side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _run_side(side: str, args: argparse.Namespace, device: torch.device, root: Path) -> dict[str, Any]:
    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointer
    from lightning_perf.parallel.checkpointing.checkpoint import save_checkpoint

    torch.manual_seed(0)
    config = GPTConfig.from_name(args.preset, **({"block_size": args.seq_len} if args.smoke else {}))
    with torch.device(device):
        model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    vocab = config.vocab_size
    x = torch.randint(0, vocab, (args.batch, args.seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    saver = AsyncCheckpointer() if side == "async" else None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, saved_at, in_flight, finals = [], [], [], []
    started = None
    total = args.warmup + args.saves * args.every
    for step in range(total):
        t0 = time.perf_counter()
        with autocast:
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        was_pending = saver is not None and saver.pending is not None
        if saver is not None and saver.pending is not None and saver.poll():
            finals.append(time.perf_counter() - started)
        save = step >= args.warmup and (step - args.warmup) % args.every == args.every - 1
        if save:
            path = root / f"{side}_{step}"
            previous = root / f"{side}_{saved_at[-1]}" if saved_at else None
            if saver is None:
                save_checkpoint(path, model, [opt], extra={"step": step})
                if previous is not None:
                    shutil.rmtree(previous)  # at most two on disk
            else:
                if saver.pending is not None:  # the previous write is still going: save() waits for it
                    saver.wait()
                    finals.append(time.perf_counter() - started)
                started = time.perf_counter()
                saver.save(path, model, [opt], extra={"step": step})
                if previous is not None:
                    saver.remove(previous)  # once this one is final
        sync()
        times.append(time.perf_counter() - t0)
        if save:
            saved_at.append(step)
        elif was_pending:
            in_flight.append(step)
    if saver is not None:
        if saver.pending is not None:
            saver.wait()
            finals.append(time.perf_counter() - started)
        saver.close()
    plain = [t for i, t in enumerate(times[args.warmup:], args.warmup) if i not in saved_at and i not in in_flight]
    step_s = statistics.median(plain)
    res: dict[str, Any] = {
        "step_ms": step_s * 1e3,
        "stall_ms": [(times[i] - step_s) * 1e3 for i in saved_at],
        "bytes": _dir_bytes(root / f"{side}_{saved_at[-1]}"),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if side == "async":
        res["slowdown_ms"] = sum(times[i] - step_s for i in in_flight) * 1e3
        res["steps_in_flight"] = len(in_flight)
        res["final_s"] = finals
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU")
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--every", type=int, default=150, help="steps between saves (more than a write takes)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.seq_len, args.batch, args.warmup, args.every, args.saves = "tiny", 64, 2, 2, 3, 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)

    tag = torch.cuda.get_device_name(device).split()[-1].lower() if device.type == "cuda" else "cpu"
    date = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / f"bench_checkpoint_{tag}{'_smoke' if args.smoke else ''}_{date}.json"
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__},
        "date": date,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "sides": {},
    }
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        for side in ("sync", "async"):
            try:
                result["sides"][side] = _run_side(side, args, device, root)
            except Exception as e:  # recorded, the other side still runs
                result["sides"][side] = {"error": f"{type(e).__name__}: {e}"}
            for p in root.iterdir():
                shutil.rmtree(p, ignore_errors=True)
            out_file.write_text(json.dumps(result, indent=2))
            print(side, json.dumps(result["sides"][side]), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    print(f"wrote {out_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
