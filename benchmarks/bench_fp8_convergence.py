"""FP8 against bf16 training quality over several seeds, in one call: ``bench_fp8.py``'s convergence part
run once per (variant, seed) in concurrent processes on one GPU, merged into one JSON and one SVG.

Each process trains the same model from its seed on the built-in corpus (real text) for the same
steps and data order, with one linear recipe (``bench_fp8.CONV_RUNS``). The runs are small and
host-bound (gpt2-124m at 8 x 512 bytes per step), so several share one GPU without changing
any loss: only their wall times, which this benchmark does not report as throughput.

Criterion per variant: the mean loss over the last 10% of steps, averaged over the seeds, against
bf16's (relative difference), next to bf16's own spread over the seeds (max - min of the same
statistic): a difference inside that spread is not one the seeds can tell apart.

    python benchmarks/bench_fp8_convergence.py --runs bf16,tensorwise,delayed --seeds 0,1,2 --out $OUT
    python benchmarks/bench_fp8_convergence.py --smoke      # CPU, tiny model, every code path
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fp8 import CONV_RUNS, curves_svg, last_10pct_mean


def summarise(per_seed: dict[str, dict[int, dict]]) -> dict:
    """Per variant: each seed's last-10% mean and validation loss, their means, and the relative
    difference of the mean against bf16's; bf16's spread over seeds."""
    out: dict = {}
    for run, seeds in per_seed.items():
        tails = {s: last_10pct_mean(r["losses"]) for s, r in seeds.items()}
        vals = {s: r.get("val_loss") for s, r in seeds.items()}
        out[run] = {"seeds": sorted(seeds), "last_10pct_mean_by_seed": tails,
                    "val_loss_by_seed": vals,
                    "last_10pct_mean": statistics.fmean(tails.values()) if tails else None,
                    "last_10pct_spread": (max(tails.values()) - min(tails.values())) if tails else None,
                    "wall_s_by_seed": {s: r.get("wall_s") for s, r in seeds.items()}}
    ref = out.get("bf16")
    if ref:
        for run, row in out.items():
            if run == "bf16":
                continue
            common = sorted(set(row["seeds"]) & set(ref["seeds"]))
            if not common:
                continue
            got = statistics.fmean(row["last_10pct_mean_by_seed"][s] for s in common)
            base = statistics.fmean(ref["last_10pct_mean_by_seed"][s] for s in common)
            row["seeds_compared"] = common
            row["rel_diff_vs_bf16"] = (got - base) / base
            row["rel_diff_vs_bf16_by_seed"] = {
                s: (row["last_10pct_mean_by_seed"][s] - ref["last_10pct_mean_by_seed"][s])
                / ref["last_10pct_mean_by_seed"][s] for s in common}
            row["within_1pct"] = abs(row["rel_diff_vs_bf16"]) <= 0.01
        ref["rel_spread_over_seeds"] = (ref["last_10pct_spread"] / ref["last_10pct_mean"]
                                        if ref["last_10pct_mean"] else None)
    return out


def mean_curves(per_seed: dict[str, dict[int, dict]]) -> dict[str, list[float]]:
    """Each variant's loss per step averaged over the seeds it finished."""
    curves = {}
    for run, seeds in per_seed.items():
        rows = [r["losses"] for r in seeds.values()]
        if rows:
            n = min(len(r) for r in rows)
            curves[f"{run} ({len(rows)} seeds)"] = [statistics.fmean(r[i] for r in rows) for i in range(n)]
    return curves


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--runs", default="bf16,tensorwise,delayed", help=f"comma list of {sorted(CONV_RUNS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--procs", type=int, default=0, help="processes at once (0: all)")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds; unfinished processes are stopped")
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in CONV_RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; choose from {sorted(CONV_RUNS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "_conv_parts"
    work.mkdir(exist_ok=True)
    jobs = [(run, seed) for seed in seeds for run in runs]
    procs = args.procs or len(jobs)
    start = time.time()
    env = dict(os.environ)
    pending, active, logs = list(jobs), {}, {}
    while pending or active:
        while pending and len(active) < procs:
            run, seed = pending.pop(0)
            dest = work / f"{run}-{seed}"
            dest.mkdir(exist_ok=True)
            cmd = [sys.executable, str(HERE / "bench_fp8.py"), "--parts", "convergence", "--conv-runs", run,
                   "--conv-seed", str(seed), "--out", str(dest)] + (["--smoke"] if args.smoke else [])
            log = open(dest / "log.txt", "w")  # noqa: SIM115 (closed when the process ends)
            active[(run, seed)] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            logs[(run, seed)] = log
        for key, proc in list(active.items()):
            if proc.poll() is not None:
                logs[key].close()
                del active[key]
                print(f"{key} finished rc={proc.returncode} at {time.time() - start:.0f} s", flush=True)
        if time.time() - start > args.deadline:
            for key, proc in active.items():
                proc.kill()
                print(f"{key} stopped at the deadline", flush=True)
            active.clear()
            break
        time.sleep(1.0)
    per_seed: dict[str, dict[int, dict]] = {r: {} for r in runs}
    failed, meta = {}, {}
    for run, seed in jobs:
        found = sorted((work / f"{run}-{seed}").glob("bench_fp8_*.json"))
        conv = json.loads(found[-1].read_text()).get("convergence", {}) if found else {}
        if isinstance(conv.get(run), dict) and "losses" in conv[run]:
            per_seed[run][seed] = conv[run]
            meta = {k: conv[k] for k in ("preset", "seq_len", "batch", "steps", "lr") if k in conv}
        else:
            log = work / f"{run}-{seed}" / "log.txt"
            failed[f"{run}-{seed}"] = log.read_text()[-1500:] if log.exists() else "not started"
    import torch

    result = {"benchmark": "bench_fp8_convergence",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
              "torch": torch.__version__, "runs": runs, "seeds": seeds, "concurrent_processes": procs,
              "wall_s": time.time() - start, **meta,
              "summary": summarise(per_seed), "failed": failed,
              "losses": {run: {str(s): r["losses"] for s, r in seeds_.items()} for run, seeds_ in per_seed.items()}}
    short = "cpu" if result["device"] == "cpu" else result["device"].split()[1].lower()
    name = f"bench_fp8_convergence_{short}_{datetime.date.today():%Y%m%d}{args.tag}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.svg").write_text(curves_svg(mean_curves(per_seed),
                                                f"{result['device']}: loss per step, mean over seeds"))
    for run, row in result["summary"].items():
        print(run, json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    print(f"wrote {out / name}.json", flush=True)


if __name__ == "__main__":
    main()
