"""How long does a sharded checkpoint stall training: synchronous save against ``AsyncCheckpointer``.

    python benchmarks/bench_checkpoint.py --out DIR                       # gpt2-124m + AdamW on one GPU, ~2 min, 3 GB of disk
    python benchmarks/bench_checkpoint.py --preset gpt-1.3b --seq-len 2048 --batch 4 --every 300 --saves 2
                                                                          # 15.8 GB per save: minutes on a slow disk
    python benchmarks/bench_checkpoint.py --smoke                         # tiny model on the CPU
    python benchmarks/bench_checkpoint.py --preempt --preset llama-8b --gpus 4 --seq-len 8192 --batch 1 \
        --ac selective --fp8 --fill-gb 1 --out DIR                       # seconds from SIGTERM to exit, 4 GPUs
    python benchmarks/bench_checkpoint.py --preempt --smoke               # the same on 2 CPU processes (gloo)

``--preempt`` asks how long a preempted run takes to leave: ``--gpus`` rank processes (started as a
launcher would: ``RANK``, ``LOCAL_RANK``, ...) train the GPT through ``Trainer`` under
``ZeroStrategy(stage=3)`` (``--pp 2``: ``Parallel3DStrategy(pipeline_parallel_size=2, zero_stage=3)``)
with its default checkpointing (in the background on GPUs) and a ``ModelCheckpoint(save_last=True)``
that does not save on its own; after ``--warmup`` steps each rank fills its GPU to within
``--fill-gb`` GB (optional: the near-full card of a real run), then the parent sends SIGTERM to every
rank at once, as SLURM and Kubernetes do. Per rank: ``exit_code`` (143 expected), ``stop_s`` (from
the signal to the stop's ``Preempted``: the step in flight, the agreement, the save and its retry if
any), ``exit_s`` (to the process's end); the checkpoint's step, size, and whether its files verify
(sizes and CRC-32). ``exit_s`` is what ``#SBATCH --signal`` / ``KillWait`` must cover
(docs/reliability.md). The JSON is ``bench_checkpoint_preempt_<device>_<date>.json``.

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
import signal
import socket
import statistics
import subprocess
import sys
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


# ---- --preempt: seconds from SIGTERM to exit ------------------------------------------------------


def _stamp(file: Path, **values: Any) -> None:
    tmp = file.with_name(file.name + ".part")
    tmp.write_text(json.dumps(values))
    os.replace(tmp, file)


def _preempt_rank(spec_path: str) -> None:
    """One rank of ``--preempt``: trains until the parent's SIGTERM stops it; leaves with the stop's exit code."""
    import lightning as L

    from lightning_perf.callbacks import Preempted
    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPTConfig, GPTLightningModule
    from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    out = Path(spec["dir"])
    gpu = spec["accelerator"] == "gpu"
    if not gpu:
        import torch as _torch

        _torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    overrides: dict[str, Any] = {"block_size": spec["seq_len"]}
    if spec["fp8"]:
        overrides["fp8"] = "tensorwise"
    if spec["smoke"]:
        overrides.update(n_layer=2, n_embd=64, n_head=2, vocab_size=256, bias=False)
    config = GPTConfig.from_name(spec["preset"], **overrides)
    module = GPTLightningModule(config, learning_rate=1e-4, warmup_steps=0, activation_checkpointing=spec["ac"])
    if spec["pp"] > 1:
        strategy: Any = Parallel3DStrategy(pipeline_parallel_size=spec["pp"], zero_stage=3, timeout=spec["timeout"])
    else:
        strategy = ZeroStrategy(stage=3, timeout=spec["timeout"])
    dp = spec["world"] // spec["pp"]
    data = TokenDataModule(source="synthetic", vocab_size=config.vocab_size, seq_len=spec["seq_len"],
                           batch_size=spec["batch"], seed=0, synthetic_train_samples=spec["batch"] * dp * 10_000,
                           synthetic_val_samples=spec["batch"])
    filler: list = []

    class Ready(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step != spec["warmup"]:
                return
            memory = {}
            if gpu and spec["fill_gb"] is not None:
                memory = _fill(filler, int(spec["fill_gb"] * 2**30))
            _stamp(out / f"rank{rank}.ready.json", time=time.time(), step=trainer.global_step, **memory)

    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=10**9, save_top_k=0,
                                                      save_last=True)
    trainer = L.Trainer(accelerator=spec["accelerator"], devices=spec["world"], precision=spec["precision"],
                        strategy=strategy, max_steps=10**6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[Ready(), checkpoints], default_root_dir=str(out))
    try:
        trainer.fit(module, data)
    except Preempted as e:
        _stamp(out / f"rank{rank}.stop.json", time=time.time(), step=e.step, path=e.path, error=e.error, code=e.code)
        raise


def _fill(keep: list, leave: int) -> dict[str, int]:
    """Allocate this GPU's free memory but ``leave`` bytes (kept in ``keep``); the free bytes before and after."""
    import torch as _torch

    before = _torch.cuda.mem_get_info()[0]
    chunk = 1 << 30
    while _torch.cuda.mem_get_info()[0] - chunk >= leave:
        keep.append(_torch.empty(chunk, dtype=_torch.uint8, device="cuda"))
    rest = _torch.cuda.mem_get_info()[0] - leave
    if rest > 1 << 20:
        keep.append(_torch.empty(rest, dtype=_torch.uint8, device="cuda"))
    return {"free_before": int(before), "free_after": int(_torch.cuda.mem_get_info()[0])}


def _run_preempt(args: argparse.Namespace, gpu: bool, root: Path) -> dict[str, Any]:
    """Start the ranks, SIGTERM them all once every one is past warm-up, and time their exits."""
    from lightning_perf.parallel.checkpointing.checkpoint import read_extra, verify_files

    world = args.gpus if gpu else 2
    spec = {"dir": str(root), "world": world, "accelerator": "gpu" if gpu else "cpu", "smoke": args.smoke,
            "precision": "bf16-mixed" if gpu else "32-true", "preset": args.preset, "seq_len": args.seq_len,
            "batch": args.batch, "ac": args.ac, "fp8": args.fp8 and gpu, "pp": args.pp, "warmup": args.warmup,
            "fill_gb": args.fill_gb if gpu else None, "timeout": args.timeout}
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", PYTHONUNBUFFERED="1")
        if not gpu:
            env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        log = open(root / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, __file__, "--preempt-rank", str(spec_path)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    res: dict[str, Any] = {"world": world, "spec": spec, "ranks": {}}
    try:
        deadline = time.time() + args.start_timeout
        while not all((root / f"rank{r}.ready.json").exists() for r in range(world)):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                res["error"] = "the ranks did not all reach the warm-up step (see rank<r>.log)"
                res["log_tails"] = {r: (root / f"rank{r}.log").read_text(errors="replace")[-3000:]
                                    for r in range(world)}
                return res
            time.sleep(0.05)
        sent = time.time()
        for p in procs:  # every rank at once, as a scheduler signals every task of the job
            os.kill(p.pid, signal.SIGTERM)
        exits: dict[int, float] = {}
        while len(exits) < world and time.time() < sent + args.exit_timeout:
            for r, p in enumerate(procs):
                if r not in exits and p.poll() is not None:
                    exits[r] = time.time()
            time.sleep(0.01)
        for r, p in enumerate(procs):
            row: dict[str, Any] = {"exit_code": p.poll(), "exit_s": round(exits[r] - sent, 3) if r in exits else None}
            ready = json.loads((root / f"rank{r}.ready.json").read_text())
            row.update({k: v for k, v in ready.items() if k.startswith("free_")})
            stop = root / f"rank{r}.stop.json"
            if stop.exists():
                got = json.loads(stop.read_text())
                row.update(stop_s=round(got["time"] - sent, 3), step=got["step"], path=got["path"], error=got["error"])
            res["ranks"][r] = row
        res["seconds_to_exit"] = max((v["exit_s"] for v in res["ranks"].values() if v["exit_s"] is not None),
                                     default=None)
        res["all_exited_with_143"] = all(v["exit_code"] == 128 + signal.SIGTERM for v in res["ranks"].values())
        path = res["ranks"].get(0, {}).get("path")
        if path:
            blob = read_extra(path)
            verify_files(path, blob["files"], local=True)  # raises on a missing, short or altered file
            res["checkpoint"] = {"path": path, "step": blob["extra"]["global_step"], "bytes": _dir_bytes(Path(path)),
                                 "verified": True}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return res


def _main_preempt(args: argparse.Namespace) -> int:
    import torch as _torch

    gpu = _torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.preset, args.seq_len, args.batch, args.warmup, args.ac = "tiny", 64, 2, 3, "none"
    tag = _torch.cuda.get_device_name(0).split()[-1].lower() if gpu else "cpu"
    date = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / f"bench_checkpoint_preempt_{tag}{'_smoke' if args.smoke else ''}_{date}.json"
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_preempt_"))
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": _torch.cuda.get_device_name(0) if gpu else "cpu",
                              "versions": {"torch": _torch.__version__}, "date": date,
                              "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                              "config": {k: v for k, v in vars(args).items() if k != "out"}}
    try:
        result["preempt"] = _run_preempt(args, gpu, root)
    finally:
        out_file.write_text(json.dumps(result, indent=2))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result["preempt"], indent=1)[:4000])
    print(f"wrote {out_file}")
    return 0


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
    parser.add_argument("--preempt", action="store_true",
                        help="time a preempted multi-rank run from SIGTERM to exit (see the module docstring)")
    parser.add_argument("--gpus", type=int, default=4, help="--preempt: rank processes, one per GPU")
    parser.add_argument("--pp", type=int, default=1, help="--preempt: pipeline stages (1: ZeroStrategy(stage=3))")
    parser.add_argument("--ac", default="selective", help="--preempt: activation checkpointing of the GPT")
    parser.add_argument("--fp8", action="store_true", help="--preempt: FP8 tensorwise linears")
    parser.add_argument("--fill-gb", type=float, default=None,
                        help="--preempt: fill each GPU to within this many GB before the signal")
    parser.add_argument("--timeout", type=float, default=600.0, help="--preempt: the strategy's collective timeout")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="--preempt: seconds to reach --warmup")
    parser.add_argument("--exit-timeout", type=float, default=900.0, help="--preempt: seconds to wait for exits")
    parser.add_argument("--preempt-rank", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.preempt_rank:
        _preempt_rank(args.preempt_rank)
        return 0
    if args.preempt:
        return _main_preempt(args)
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
