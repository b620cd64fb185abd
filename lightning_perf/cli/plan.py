"""``lightning-perf plan``: the memory planner on a recipe, before any GPU is taken.

    lightning-perf plan --config llama-8b-zero3                          # the local GPU's memory
    lightning-perf plan --config llama-8b-zero3 --gpu-memory-gb 85      # another card (GB = 10^9 bytes)
    lightning-perf plan --config llama-8b-zero3 --trainer.devices 8 --data.batch_size 2 --json

It takes ``fit``'s arguments (a recipe by name or file, and overrides) and reads them as ``fit`` would (the
module, the data module and the strategy are built, no Trainer and no process), then prints the predicted
peak per GPU by part and the settings chosen for ``"auto"`` values (or checks the explicit ones): the table,
or with ``--json`` one JSON object with ``fits``, ``peak_gb``, ``gpu_memory_gb``, ``batch_size``,
``activation_checkpointing``, ``accumulate_grad_batches`` and the parts.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import torch

from lightning_perf.cli.perf_cli import PerfCLI, _run_lightning_cli
from lightning_perf.cli.recipes import _option_value, _with_resolved_config
from lightning_perf.perf.memory_plan import GB
from lightning_perf.runtime.planning import TrainingPlan, plan_run, usable_bytes

__all__ = ["plan_main"]

_USAGE = ("usage: lightning-perf plan [--config NAME|FILE] [fit's overrides ...] [--gpu-memory-gb G] [--json]\n"
          "Predicts the peak GPU memory of `lightning-perf fit` with the same arguments, by part, and the "
          "settings the planner takes for 'auto' values.")


class _PlanCLI(PerfCLI):
    """``fit``'s parser and classes, with the Trainer replaced by the plan: nothing is started."""

    capacity_bytes: Optional[float] = None
    as_json: bool = False
    needs_device = False

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        self.trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        return None

    def _run_subcommand(self, subcommand: str) -> None:
        report(self.model, self.datamodule, self.trainer_config, capacity_bytes=type(self).capacity_bytes,
               as_json=type(self).as_json)


def _devices(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else max(1, torch.cuda.device_count())
    if isinstance(value, (list, tuple)):
        return len(value)
    text = str(value)
    if text.isdigit():
        return int(text)
    if text == "-1" or text == "auto":
        return max(1, torch.cuda.device_count())
    return len([x for x in text.split(",") if x.strip()])


def _strategy_name(strategy: Any) -> str:
    if strategy is None or isinstance(strategy, str):
        return str(strategy or "auto")
    config = getattr(strategy, "config", None)
    stage = getattr(config, "stage", None)
    return f"{type(strategy).__name__}" + (f"(stage={stage})" if stage is not None else "")


def make_plan(module: Any, datamodule: Any, trainer_config: dict[str, Any], *,
              capacity_bytes: Optional[float]) -> TrainingPlan:
    """The plan of a run with these objects and Trainer arguments."""
    return plan_run(module, trainer_config.get("strategy"), datamodule,
                    devices=_devices(trainer_config.get("devices", "auto")),
                    num_nodes=int(trainer_config.get("num_nodes") or 1),
                    accumulate_grad_batches=int(trainer_config.get("accumulate_grad_batches") or 1),
                    capacity_bytes=capacity_bytes, precision=str(trainer_config.get("precision") or "32-true"))


def report(module: Any, datamodule: Any, trainer_config: dict[str, Any], *, capacity_bytes: Optional[float],
           as_json: bool) -> TrainingPlan:
    plan = make_plan(module, datamodule, trainer_config, capacity_bytes=capacity_bytes)
    devices = _devices(trainer_config.get("devices", "auto")) * int(trainer_config.get("num_nodes") or 1)
    if as_json:
        out = plan.as_dict()
        out.update(model=module.config.name, devices=devices, strategy=_strategy_name(trainer_config.get("strategy")),
                   seq_len=datamodule.seq_len, global_batch_sequences=plan.batch_size * plan.accumulate_grad_batches)
        out["candidates"] = plan.candidates
        print(json.dumps(out, indent=2, default=str))
        return plan
    cfg = module.config
    cap = "no GPU given" if capacity_bytes is None else (
        f"{capacity_bytes / GB:.1f} GB per GPU, {usable_bytes(capacity_bytes) / GB:.1f} GB usable for the allocated "
        "peak (the rest: the CUDA context, NCCL, fragmentation headroom)")
    lines = [f"lightning-perf plan: {cfg.name} ({cfg.num_params() / 1e9:.2f}B parameters) on {devices} GPU(s), "
             f"{_strategy_name(trainer_config.get('strategy'))}, T={datamodule.seq_len}, "
             f"{trainer_config.get('precision')}",
             f"card: {cap}",
             f"choice: batch_size {plan.batch_size}, activation_checkpointing {plan.activation_checkpointing}, "
             f"accumulate_grad_batches {plan.accumulate_grad_batches}"
             + (f", ZeRO accumulation {plan.accumulation}" if plan.accumulation and plan.accumulate_grad_batches > 1
                else "")
             + (f"  (auto: {', '.join(plan.auto)})" if plan.auto else ""), "",
             f"{'part (largest rank, ' + plan.estimate.peak_rank.moment + ')':<48} {'GB':>7}"]
    for name, value in plan.estimate.parts_gb.items():
        lines.append(f"  {name:<46} {value:>7.2f}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  {'peak allocated per GPU':<46} {plan.peak_gb:>7.2f}  {verdict}")
    if len(plan.estimate.ranks) > 1:
        lines.append("  per pipeline rank: " + ", ".join(f"{g:.1f}" for g in plan.estimate.per_rank_gb))
    fitting = sorted((c for c in plan.candidates if c["fits"]), key=lambda c: -c["speed"])[:4]
    if len(plan.candidates) > 1 and fitting:
        lines += ["", "fastest that fit (batch_size, activation_checkpointing, accumulate, predicted GB):"]
        lines += [f"  {c['batch_size']}, {c['activation_checkpointing']}, {c['accumulate_grad_batches']}"
                  + (f", {c['accumulation']}" if c.get("accumulation") and c["accumulate_grad_batches"] > 1 else "")
                  + f": {c['peak_gb']:.1f}" for c in fitting]
    if not plan.fits and plan.largest_fitting is None:
        lines += ["", "nothing at this layout fits: more GPUs, zero3, tensor / pipeline parallelism or offload"]
    print("\n".join(lines))
    return plan


def _local_capacity() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory)


def plan_main(args: list[str]) -> None:
    """``lightning-perf plan ARGS``: see the module docstring."""
    if any(a in ("-h", "--help") for a in args):
        print(_USAGE)
        return
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    gb = _option_value(args, "gpu-memory-gb")
    rest: list[str] = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--gpu-memory-gb":
            skip = True
            continue
        if a.startswith("--gpu-memory-gb="):
            continue
        rest.append(a)
    if gb is not None:
        try:
            capacity: Optional[float] = float(gb) * GB
        except ValueError:
            raise SystemExit(f"lightning-perf plan: error: --gpu-memory-gb takes a number of GB, got {gb!r}") from None
        if capacity <= 0:
            raise SystemExit(f"lightning-perf plan: error: --gpu-memory-gb must be positive, got {gb}")
    else:
        capacity = _local_capacity()
        if capacity is None:
            raise SystemExit("lightning-perf plan: error: no GPU on this machine: give the card's memory, e.g. "
                             "--gpu-memory-gb 85 (an 80 GB H100) or 150 (an H200)")
    _PlanCLI.capacity_bytes, _PlanCLI.as_json = capacity, as_json
    _run_lightning_cli(_with_resolved_config(["fit", *rest]), cli_class=_PlanCLI, switch_to_cpu=False)


if __name__ == "__main__":  # pragma: no cover
    plan_main(sys.argv[1:])
