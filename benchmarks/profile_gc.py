"""What a training step leaves for Python's garbage collector, per kernel choice.

A plain compiled loop over the GPT with the collector off: after warm-up everything alive is frozen,
then ``--steps`` more steps run and the objects they leave (tracked by the collector) are counted
by type, functions and code objects by qualified name, before one timed collection.

    python benchmarks/profile_gc.py --out $OUT                 # gpt2-124m, kernels torch and triton
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def census(model_name: str, kernels: str, extra: dict, steps: int, warmup: int, batch: int, seq: int) -> dict:
    from lightning_perf.models import GPT, GPTConfig

    cfg = GPTConfig.from_name(model_name, kernels=kernels, attention="auto" if kernels == "triton" else "sdpa",
                              **extra)
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    gc.freeze()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    objs = gc.get_objects()
    types = collections.Counter(type(o).__name__ for o in objs)
    funcs = collections.Counter(f"{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', '?')}"
                                for o in objs if type(o).__name__ == "function")
    cells_owner = collections.Counter()
    for o in objs:
        if type(o).__name__ == "cell":
            for r in gc.get_referrers(o)[:2]:
                if type(r).__name__ == "tuple":
                    for f in gc.get_referrers(r)[:2]:
                        if type(f).__name__ == "function":
                            cells_owner[f"{f.__module__}.{f.__qualname__}"] += 1
            if sum(cells_owner.values()) > 20000:
                break
    n = len(objs)
    del objs
    t = time.perf_counter()
    freed = gc.collect()
    pause = time.perf_counter() - t
    gc.unfreeze()
    gc.enable()
    return {
        "kernels": kernels, "extra": extra, "steps": steps, "tracked_objects": n, "per_step": n / steps,
        "collected": freed, "collect_ms": 1e3 * pause,
        "types": types.most_common(20), "functions": funcs.most_common(20), "cell_owners": cells_owner.most_common(10),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    rows = []
    for kernels, extra in (("torch", {}), ("triton", {"fused_qkv": True})):
        rows.append(census(args.model, kernels, extra, args.steps, args.warmup, args.batch, args.seq))
        print(json.dumps({k: rows[-1][k] for k in ("kernels", "per_step", "collect_ms")}), flush=True)
        print(json.dumps(rows[-1]["functions"][:8]), flush=True)
        print(json.dumps(rows[-1]["types"][:10]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_gc_{torch.cuda.get_device_name().split()[1].lower()}_{time.strftime('%Y%m%d')}.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
