"""Each recipe as a user runs it (``lightning-perf fit --config NAME``) against the baseline a user
would pick instead.

The recipe side goes through the CLI entry point: LightningCLI, the recipe's precision, strategy,
clipping, loggers, checkpoint callback, callbacks and progress bar, on synthetic tokens for
``warmup + steps`` steps; a validation pass (the recipe's ``limit_val_batches``) and one checkpoint
save are timed after the window. The baseline runs in the same call on the same GPUs:

- a single-GPU recipe (``plain``): a plain PyTorch loop over the equivalent GPT (PyTorch kernels,
  SDPA attention, no FP8, separate q/k/v, whole model compiled), with the recipe's batch, sequence
  length, fused AdamW, bf16 autocast, gradient clipping and learning-rate schedule (warm-up and
  cosine over the same steps: both sides then multiply the same values, and a GPU at its power
  limit clocks by the values it multiplies);
- a multi-GPU recipe (``fsdp``): Lightning's own ``FSDPStrategy`` (FULL_SHARD, one unit per block)
  on the recipe's devices, training the same GPT through ``GPTLightningModule`` with PyTorch kernels,
  compiled per block (``--fsdp_compile_scope model``: the whole model), the recipe's precision,
  fused AdamW and gradient clipping (through FSDP's own ``clip_grad_norm_``: Lightning's FSDP
  refuses clipping by norm from the Trainer), and full activation checkpointing per block where the
  recipe checkpoints activations (Lightning has no selective mode). Same sequence length and the
  same sequences per step: the recipe's ``batch_size`` times its data-parallel size, split over
  every GPU;
- and beside it (``mp``): Lightning's ``ModelParallelStrategy`` with FSDP2 applied in the module's
  ``configure_model`` (``fully_shard`` per block after ``torch.compile`` per block, fp32 master
  weights with bf16 compute through ``MixedPrecisionPolicy``, fused AdamW, the same clipping and
  checkpointing; ``_baselines.ModelParallelGPT``), the strongest Lightning-native path. ``--baselines``
  picks either or both (default both).

Both sides are timed by the same window callback (``_timing.WallClockWindow``); a side killed by
``--timeout`` (or failing) after its window closed keeps the window's figures, with a warning. Headline: tokens /
wall time over the window after warm-up (the mean a user pays, slow steps included); also the
median and p90 step, the slowest steps, garbage collections and Dynamo recompilations inside the
window, peak memory (rank 0) and MFU per GPU against the bf16 datasheet peak. The JSON row holds
``recipe_vs_plain`` or ``recipe_vs_fsdp``.

Startup and exit: each recipe run (and each variant) also reports ``startup``, the seconds from its
process's start to the end of its first training step (``start_to_first_step_s``) and from the end of
its last step to its process's exit (``last_step_to_exit_s``), with the phases between: imports,
CLI and Trainer, environment (device, process group), model build, strategy set-up, the first
steps (compilation and tuning), the final hooks (a checkpoint), teardown and the process's end
(``_phases.phases``). The marks come from the run itself (``_phases.PhaseTimes``, a Lightning profiler
that sees every hook the Trainer calls, added to the recipe's command line) and from the OS (the
process's start); the exit is when the process ended, as this script saw it, and
``left_running_after_exit`` lists what the process left behind in its session (killed). Every side
compiles into caches of its own, emptied first (a cold start; ``--cache_root``, default a temporary
folder); ``--warm_cache`` runs the recipe a second time against the caches its first run filled
(``recipe_warm``). The children run as ``lightning-perf`` does (``main(..., command=True)``: its cache
settings, its end).

    python benchmarks/bench_recipes.py --out $OUT                               # the single-GPU recipes
    python benchmarks/bench_recipes.py --recipes gpt2-124m --steps 60           # one recipe
    python benchmarks/bench_recipes.py --recipes gpt-1.3b-zero3,gpt-1.3b-tp2,gpt-1.3b-pp2 --steps 30 --warmup 10
    python benchmarks/bench_recipes.py --recipes llama-8b-3d --steps 10 --warmup 5   # 8 GPUs
    python benchmarks/bench_recipes.py --recipes llama-8b-zero3 --baselines mp --baseline_batch 2 --steps 8 \
        --warmup 4 --no_checkpoint --no_validation --timeout 400    # 4 H200; the baseline holds 2 sequences
    python benchmarks/bench_recipes.py --recipes gpt-1.3b --profile 4           # kernels and GPU idle, both sides
    python benchmarks/bench_recipes.py --recipes gpt-1.3b-fp8 --steps 20 --warmup 10 --no_checkpoint \
        --no_validation --variant tensorwise=--bench.fp8=tensorwise   # shipped FP8 recipe (delayed), tensorwise, plain bf16
    python benchmarks/bench_recipes.py --recipes gpt-1.3b-fp8 --variant mlp-unfused=--bench.fp8_mlp=unfused
        # the FP8 recipe, and the same with its MLPs as two delayed layers around a separate GELU
    python benchmarks/bench_recipes.py --recipes gpt-1.3b --variant clip-in-place=--bench.clip=in_place
        # the recipe, and the recipe with its clipping as a separate pass before the fused step
    python benchmarks/bench_recipes.py --recipes gpt-1.3b-fp8 --steps 20 --warmup 10 --no_baseline --warm_cache \
        --no_checkpoint --no_validation --timeout 200 --tag startup   # startup and exit, cold then warm (1 GPU)
    python benchmarks/bench_recipes.py --smoke                                  # CPU: the code paths only

A multi-GPU recipe runs as Lightning launches it: the child process this script starts is rank 0,
and Lightning's launcher re-runs the same command line for the other ranks, so the child entry point
(``--child``) is re-entrant. Run the script with plain ``python``, never under ``torchrun``. The
smoke runs the multi-GPU path on 2 gloo processes (``gpt-1.3b-zero3``: the recipe's strategy
against the baseline's child; Lightning's FSDPStrategy requires a GPU, so on the CPU that child
runs under Lightning's DDP in fp32 instead and the FSDP lines themselves run only on GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _phases  # noqa: E402  (benchmarks/ is on the path from here)

PEAK_BF16 = {"h100": 989e12, "h200": 989e12}  # dense bf16 datasheet, SXM parts


def _recipe(name: str) -> dict:
    import yaml

    from lightning_perf.cli import resolve_recipe

    return yaml.safe_load(resolve_recipe(name).read_text())


def _model_config(recipe: dict):
    from lightning_perf.models import GPTLightningModule

    return GPTLightningModule(**recipe.get("model", {})).config


def _plain_config(recipe: dict):
    """The recipe's model as a plain GPT: PyTorch kernels, SDPA attention, no FP8, separate q/k/v."""
    cfg = _model_config(recipe)
    plain = {"kernels": "torch", "attention": "sdpa", "fp8": False, "fused_qkv": False}
    return dataclasses.replace(cfg, **{k: v for k, v in plain.items() if hasattr(cfg, k)})


def _schedule(recipe: dict) -> dict:
    """The recipe's optimizer settings, the module's defaults where the recipe leaves them out."""
    import inspect

    from lightning_perf.models import GPTLightningModule

    defaults = inspect.signature(GPTLightningModule.__init__).parameters
    model_args = recipe.get("model") or {}
    return {k: type(defaults[k].default)(model_args.get(k, defaults[k].default))
            for k in ("learning_rate", "weight_decay", "warmup_steps", "min_lr_ratio")}


def _devices(recipe: dict) -> int:
    devices = (recipe.get("trainer") or {}).get("devices", 1)
    return 1 if devices in (None, "auto") else int(devices)


def _data_parallel_size(recipe: dict) -> int:
    """How many data-parallel replicas the recipe's strategy makes of its devices (each reads its own batch)."""
    from lightning_perf.parallel import ParallelDims

    devices = _devices(recipe)
    strategy = (recipe.get("trainer") or {}).get("strategy")
    if isinstance(strategy, dict) and strategy.get("class_path", "").endswith("Parallel3DStrategy"):
        args = strategy.get("init_args") or {}
        return ParallelDims(data_parallel_size=args.get("data_parallel_size", "auto"),
                            tensor_parallel_size=int(args.get("tensor_parallel_size", 1)),
                            pipeline_parallel_size=int(args.get("pipeline_parallel_size", 1)),
                            world_size=devices).data_parallel_size
    return devices


def _activation_checkpointing(recipe: dict, name: Optional[str] = None) -> str:
    """The recipe's checkpointing mode; for ``"auto"``, what the memory planner chooses for it on this machine's
    GPU (``lightning-perf plan --json``), so a baseline checkpoints only where the recipe does."""
    strategy = (recipe.get("trainer") or {}).get("strategy")
    args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    mode = args.get("activation_checkpointing") or (recipe.get("model") or {}).get("activation_checkpointing", "none")
    if mode != "auto" or name is None:
        return mode
    import torch

    cmd = [sys.executable, "-m", "lightning_perf", "plan", "--config", name, "--json"]
    if not torch.cuda.is_available():
        cmd += ["--gpu-memory-gb", "85"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or "{" not in out.stdout:
        raise SystemExit(f"lightning-perf plan --config {name} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])["activation_checkpointing"]


def _replica_batch(recipe: dict) -> int:
    """Sequences per optimizer step on one data-parallel replica: the recipe's ``batch_size``, or with
    ``batch_size: auto`` its global batch (``global_batch_size`` / ``global_batch_tokens``, scaled to the
    recipe's GPUs by ``global_batch_per_gpus``) over its data-parallel size."""
    data = recipe.get("data") or {}
    batch = data.get("batch_size", 8)
    if batch != "auto":
        return int(batch)
    sequences = data.get("global_batch_size")
    if data.get("global_batch_tokens") is not None:
        sequences = int(data["global_batch_tokens"]) // int(data.get("seq_len", 1024))
    if sequences is None:
        raise SystemExit("a recipe with batch_size: auto needs global_batch_size or global_batch_tokens here")
    per_gpus = data.get("global_batch_per_gpus")
    if per_gpus:
        sequences = int(sequences) * _devices(recipe) // int(per_gpus)
    return int(sequences) // _data_parallel_size(recipe)


def _fsdp_batch(recipe: dict) -> int:
    """Sequences per GPU for the FSDP baseline: the recipe's sequences per step over all its devices."""
    batch, devices = _replica_batch(recipe), _devices(recipe)
    per_step = batch * _data_parallel_size(recipe)
    if per_step % devices:
        raise SystemExit(f"recipe trains {batch} x dp({_data_parallel_size(recipe)}) = {per_step} sequences per step, "
                         f"not divisible over {devices} GPUs for the FSDP baseline")
    return per_step // devices


SMOKE_SEQ_LEN = 64


def _smoke_overrides(recipe: dict) -> list[str]:
    """CPU stand-ins: the tiny Llama, uncompiled, short sequences; the recipe's batch (whole microbatches)."""
    args = ["--trainer.accelerator", "cpu", "--model.config", "tiny-llama", "--model.config_overrides", "null",
            "--model.compile", "null", "--data.seq_len", str(SMOKE_SEQ_LEN), "--data.num_workers", "0"]
    strategy = (recipe.get("trainer") or {}).get("strategy")
    if isinstance(strategy, dict) and "compile" in (strategy.get("init_args") or {}):
        args += ["--trainer.strategy.init_args.compile", "null"]
    if isinstance(strategy, dict) and (strategy.get("init_args") or {}).get("fp8_all_gather"):
        args += ["--trainer.strategy.init_args.fp8_all_gather", "false"]  # the stand-in has no FP8 linears
    return args


def _without_checkpoints(recipe: dict, path: Path) -> Path:
    """The recipe written to ``path`` without its ``ModelCheckpoint`` callbacks (whose ``save_last`` saves the
    whole training state when the fit ends), for ``--no_checkpoint``; the run adds
    ``--trainer.enable_checkpointing false`` so that Lightning adds no default one either."""
    import yaml

    trainer = dict(recipe.get("trainer") or {})
    trainer["callbacks"] = [c for c in trainer.get("callbacks") or []
                            if not (isinstance(c, dict) and str(c.get("class_path", "")).endswith("ModelCheckpoint"))]
    path.write_text(yaml.safe_dump(dict(recipe, trainer=trainer), sort_keys=False))
    return path


def run_recipe(name: str, steps: int, warmup: int, out: Path, smoke: bool, extra: list[str], *,
               command: bool = False) -> None:
    """Child process: the recipe through ``lightning_perf.cli.main`` with the window callback added.

    ``command``: as ``lightning-perf fit`` runs (its cache settings; the process ends with the fit), with
    the phase marks (``_phases.PhaseTimes``) written beside the result: this script's children. Without
    it the caller goes on after the fit (``bench_hf_import.py`` adds to the result)."""
    from lightning_perf.cli import main

    if command:
        _phases.mark("imports_done")
        _phases.watch_bypasses()
    recipe = _recipe(name)
    data = recipe.get("data") or {}
    total = warmup + steps
    os.environ["BENCH_WINDOW_OUT"] = str(out)
    os.environ["BENCH_WINDOW_WARMUP"] = str(warmup)
    config = name
    if os.environ.get("BENCH_WINDOW_CHECKPOINT") == "0":  # --no_checkpoint: nothing saved, the recipe's saves too
        config = str(_without_checkpoints(recipe, out.with_name(f"{out.stem}-no-checkpoint.yaml")))
    args = [
        "fit", "--config", config,
        "--data.source", "synthetic", "--data.data_dir", "null",
        "--data.synthetic_train_samples", str(_replica_batch(recipe) * (total + 4) * 8),
        "--trainer.max_steps", str(total),
        "--trainer.val_check_interval", str(total),
        "--trainer.default_root_dir", str(out.parent / f"run-{name}"),
        "--trainer.callbacks+=_timing.WallClockWindow",
    ]
    if command:
        profiler = {"class_path": "_phases.PhaseTimes", "init_args": {"out": str(phases_file(out))}}
        args.append("--trainer.profiler=" + json.dumps(profiler))
    if config != name:
        args += ["--trainer.enable_checkpointing", "false"]
    if smoke:
        args += _smoke_overrides(recipe)
    if os.environ.get("BENCH_NO_VALIDATION") == "1":  # no validation pass after the window (nor its compile)
        args += ["--trainer.limit_val_batches", "0"]
    fp8 = [a.partition("=")[2] for a in extra if a.startswith("--bench.fp8=")]
    if fp8:  # a variant only: the recipe's model with another FP8 recipe (e.g. "delayed")
        extra = [a for a in extra if not a.startswith("--bench.fp8=")]
        args += _fp8_overrides(recipe, fp8[-1], smoke)
    if "--bench.fp8_linear=torchao" in extra:  # a variant only: torchao's tensorwise matmul throughout
        extra = [a for a in extra if a != "--bench.fp8_linear=torchao"]
        _torchao_matmuls_only()
    if "--bench.fp8_mlp=unfused" in extra:  # a variant only: delayed GELU MLPs run as their two layers + GELU
        extra = [a for a in extra if a != "--bench.fp8_mlp=unfused"]
        from lightning_perf.kernels import torchao_fp8 as float8

        float8.delayed_gelu_mlp = lambda x, up, down: None
    if "--bench.clip=in_place" in extra:  # a variant only: clipping rewrites the gradients before the step
        extra = [a for a in extra if a != "--bench.clip=in_place"]
        from lightning_perf.plugins import precision

        precision.fold_clip_into_fused_step = lambda optimizer, max_norm: False
    main(args + extra, command=command)
    if config != name:
        Path(config).unlink(missing_ok=True)


def phases_file(out: Path) -> Path:
    """Where a child's phase marks go (``_phases.PhaseTimes``), beside its result ``out``."""
    return out.with_name(out.name + ".phases")


def _fp8_overrides(recipe: dict, fp8: str, smoke: bool) -> list[str]:
    """CLI arguments that run the recipe's model with ``GPTConfig.fp8 = fp8``, its other overrides kept
    (the smoke's tiny model has none)."""
    from lightning_perf.kernels.torchao_fp8 import normalize_fp8

    overrides = {} if smoke else dict((recipe.get("model") or {}).get("config_overrides") or {})
    overrides["fp8"] = normalize_fp8(False if fp8.lower() in ("false", "none", "off") else fp8)
    return ["--model.config_overrides", json.dumps(overrides, separators=(",", ":"))]


def _torchao_matmuls_only() -> None:
    """Tensorwise FP8 layers run torchao's matmul for plain weights too (not ``kernels.ops.fp8_linear``)."""
    from lightning_perf.kernels import torchao_fp8 as float8

    float8._pack_path = lambda x, weight: False


def run_plain(name: str, steps: int, warmup: int, out: Path, smoke: bool, extra: list[str]) -> None:
    """Child process: the plain loop over the equivalent GPT (see the module docstring), run by
    ``_baselines.plain_training_loop``."""
    import torch
    from _baselines import plain_training_loop

    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPT, GPTConfig
    from lightning_perf.models.gpt.module import cosine_with_warmup

    recipe = _recipe(name)
    trainer_args, data = recipe.get("trainer") or {}, recipe.get("data") or {}
    cfg = _plain_config(recipe)
    seq_len, batch = int(data.get("seq_len", 1024)), _replica_batch(recipe)
    compile_mode = "default"
    if smoke:
        cfg, seq_len, compile_mode = GPTConfig.from_name("tiny-llama"), SMOKE_SEQ_LEN, None
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(1234)
    with torch.device(device):
        model = GPT(cfg)
    if compile_mode:
        model = torch.compile(model, mode=compile_mode)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    hp = _schedule(recipe)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp["learning_rate"], betas=(0.9, 0.95), fused=True,
    )
    clip = trainer_args.get("gradient_clip_val")
    total = warmup + steps
    # the recipe's learning-rate schedule over the same number of steps: both sides train the same
    # trajectory, so their kernels see the same values (a GPU's clock under its power limit depends on them)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: cosine_with_warmup(
        step, warmup_steps=hp["warmup_steps"], total_steps=total, min_lr_ratio=hp["min_lr_ratio"]))
    dm = TokenDataModule(source="synthetic", vocab_size=cfg.vocab_size, seq_len=seq_len, batch_size=batch,
                         num_workers=int(data.get("num_workers", 0)) if not smoke else 0,
                         synthetic_train_samples=batch * (total + 4))
    dm.setup("fit")
    amp = device.type == "cuda" and trainer_args.get("precision", "bf16-mixed") == "bf16-mixed"
    result = plain_training_loop(model, opt, iter(dm.train_dataloader()), steps=steps, warmup=warmup, device=device,
                                 tokens_per_step=batch * seq_len, amp=amp, clip=clip, schedule=schedule,
                                 profile_steps=int(os.environ.get("BENCH_PROFILE_STEPS", 0)),
                                 profile_trace=str(out.parent / f"profile_{out.name}"))
    out.write_text(json.dumps({
        **result,
        "model": {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "kernels", "attention")},
    }, indent=2))


def _fit_baseline(recipe: dict, module: Any, strategy: Any, precision: str, cfg: Any, seq_len: int, batch: int,
                  steps: int, warmup: int, out: Path, smoke: bool, **facts: Any) -> None:
    """Train a multi-GPU baseline side for ``warmup + steps`` steps on synthetic tokens under the recipe's
    devices and clipping, timed by the recipe side's window callback; rank 0 adds ``facts`` to the result."""
    import lightning as L

    from _timing import WallClockWindow
    from lightning_perf.data import TokenDataModule

    trainer_args, data = recipe.get("trainer") or {}, recipe.get("data") or {}
    total = warmup + steps
    trainer = L.Trainer(
        accelerator="cpu" if smoke else "gpu", devices=_devices(recipe), num_nodes=1, strategy=strategy,
        precision=precision,
        gradient_clip_val=trainer_args.get("gradient_clip_val"),
        max_steps=total, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[WallClockWindow(warmup=warmup, out=str(out))],
    )
    dm = TokenDataModule(source="synthetic", vocab_size=cfg.vocab_size, seq_len=seq_len, batch_size=batch,
                         num_workers=0 if smoke else int(data.get("num_workers", 0)),
                         synthetic_train_samples=batch * _devices(recipe) * (total + 4))
    L.seed_everything(1234, verbose=False)
    trainer.fit(module, datamodule=dm)
    if trainer.is_global_zero:
        result = json.loads(out.read_text())
        result["model"] = {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "kernels",
                                                        "attention")}
        result.update(batch_per_gpu=batch, devices=_devices(recipe), **facts)
        out.write_text(json.dumps(result, indent=2))


def _baseline_shape(recipe: dict, smoke: bool) -> tuple[Any, int, int, Any]:
    """(plain GPT config, sequence length, sequences per GPU, compile mode) of a multi-GPU baseline."""
    from lightning_perf.models import GPTConfig

    data = recipe.get("data") or {}
    batch = _BASELINE_BATCH or _fsdp_batch(recipe)
    if smoke:
        return GPTConfig.from_name("tiny-llama"), SMOKE_SEQ_LEN, batch, None
    return _plain_config(recipe), int(data.get("seq_len", 1024)), batch, "default"


# --baseline_batch: sequences per GPU of a multi-GPU baseline where the recipe's would not fit it
_BASELINE_BATCH: Optional[int] = None


def run_fsdp(name: str, steps: int, warmup: int, out: Path, smoke: bool, extra: list[str],
             compile_scope: str = "block") -> None:
    """Child process (rank 0; Lightning's launcher re-runs it for the other ranks): the same GPT under
    Lightning's FSDPStrategy, timed by the recipe side's window callback (see the module docstring)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from typing_extensions import override

    from lightning_perf.models import GPTLightningModule
    from lightning_perf.models.gpt.model import Block

    class FSDPClippedGPT(GPTLightningModule):
        @override
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            if not isinstance(self.trainer.strategy, FSDPStrategy):
                return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            # Lightning's FSDP precision plugin refuses clipping by norm; the FSDP root clips across shards
            if gradient_clip_val:
                self.trainer.model.clip_grad_norm_(float(gradient_clip_val))

    recipe = _recipe(name)
    cfg, seq_len, batch, compile_mode = _baseline_shape(recipe, smoke)
    module = FSDPClippedGPT(cfg, **_schedule(recipe), fused_adam=True, compile=compile_mode,
                            compile_scope=compile_scope)
    checkpointing = _activation_checkpointing(recipe, name) != "none"
    strategy = FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}, state_dict_type="sharded",
                            activation_checkpointing_policy={Block} if checkpointing else None)
    precision = (recipe.get("trainer") or {}).get("precision", "bf16-mixed")
    if smoke:  # Lightning's FSDPStrategy requires a GPU: on the CPU this child runs under DDP (gloo) instead,
        # in fp32 (Lightning's bf16-mixed plugin refuses to clip beside a fused AdamW)
        strategy, precision = "ddp", "32-true"
    _fit_baseline(recipe, module, strategy, precision, cfg, seq_len, batch, steps, warmup, out, smoke,
                  compile_scope=compile_scope, activation_checkpointing="full" if checkpointing else "none")


def run_model_parallel(name: str, steps: int, warmup: int, out: Path, smoke: bool, extra: list[str]) -> None:
    """Child process (rank 0; Lightning's launcher re-runs it for the other ranks): the same GPT under
    Lightning's ModelParallelStrategy with FSDP2 and per-block compile applied in ``configure_model``
    (``_baselines.ModelParallelGPT``), the recipe's sequences, clipping and learning rate, timed by the
    recipe side's window callback."""
    from _baselines import ModelParallelGPT, model_parallel_strategy

    recipe = _recipe(name)
    cfg, seq_len, batch, compile_mode = _baseline_shape(recipe, smoke)
    checkpointing = "full" if _activation_checkpointing(recipe, name) != "none" else "none"
    module = ModelParallelGPT(cfg, compile=compile_mode, activation_checkpointing=checkpointing,
                              learning_rate=float((recipe.get("model") or {}).get("learning_rate", 3e-4)))
    # the MixedPrecisionPolicy casts (bf16 compute, fp32 master weights and reduction): no autocast
    _fit_baseline(recipe, module, model_parallel_strategy(_devices(recipe)), "32-true", module.config, seq_len,
                  batch, steps, warmup, out, smoke, compile_scope="block", activation_checkpointing=checkpointing,
                  baseline="ModelParallelStrategy + fully_shard")


def _child(kind: str, name: str, args: argparse.Namespace, out: Path, extra: str = "",
           cache: Optional[Path] = None) -> dict:
    """Run one side in a process of its own (a session of its own: a timeout kills the ranks Lightning's
    launcher started with it); its output goes to a log file, so the process's exit is its own, not that
    of a helper holding a pipe. ``cache``: the compile caches it uses (``compile_cache_env``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--recipes", name,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out.parent),
           f"--child_args={extra}"]
    if args.smoke:
        cmd.append("--smoke")
    if kind == "fsdp":
        cmd += ["--fsdp_compile_scope", args.fsdp_compile_scope]
    if args.baseline_batch and kind in ("fsdp", "mp"):
        cmd += ["--baseline_batch", str(args.baseline_batch)]
    window = out.with_name(out.name + ".window")  # written when the window closes (see _timing)
    window.unlink(missing_ok=True)
    phases_file(out).unlink(missing_ok=True)
    env = dict(os.environ, **(compile_cache_env(cache) if cache is not None else {}))
    log = out.with_name(out.name + ".log")
    launched = time.time()
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        timed_out = False
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        exited = time.time()
        left = _kill_session(proc.pid)  # on a timeout the child, otherwise what it left running
        proc.wait()
    elapsed = time.perf_counter() - t
    output = log.read_text(errors="replace")
    log.unlink(missing_ok=True)
    if timed_out:
        output += f"\ntimed out after {args.timeout}s"
    tail = output[-4500:] if proc.returncode else ""
    result = child_result(out, proc.returncode, tail, elapsed)
    startup = startup_record(phases_file(out), launched, None if timed_out else exited)
    if startup:
        result["startup"] = dict(startup, **({"left_running_after_exit": left} if left and not timed_out else {}))
    phases_file(out).unlink(missing_ok=True)
    out.with_name(f"{out.stem}-no-checkpoint.yaml").unlink(missing_ok=True)  # run_recipe's --no_checkpoint recipe
    if "warning" in result:
        print(f"[{kind} {name}] ended with rc={proc.returncode} after its window; the window stands", flush=True)
    elif "error" in result:
        print(f"[{kind} {name}] failed (rc={proc.returncode}):\n{tail}", flush=True)
    return result


def _kill_session(pgid: int) -> list[str]:
    """SIGKILL every process left in session ``pgid`` (its leader's group); their command lines, as found."""
    left = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            if os.getpgid(int(entry.name)) != pgid or stat[stat.rindex(")") + 2] == "Z":
                continue  # another session's, or one that has exited and waits to be reaped
            left.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160])
        except (OSError, ValueError):
            continue
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return left


def startup_record(path: Path, launched: float, exited: Optional[float]) -> dict:
    """A child's phase marks (``path``, written by ``_phases.PhaseTimes`` and the child) with its launch and
    exit as the parent saw them, and the durations between them (``_phases.phases``); {} without marks."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    marks = dict(data.get("marks") or {})
    marks["launched"] = launched
    marks.setdefault("process_start", launched)  # no /proc: the parent's clock just before it started it
    if exited is not None:
        marks["process_exit"] = exited
    return dict(_phases.phases(marks), steps_seen=data.get("steps"), checkpoint_save_s=data.get("checkpoint_save_s"),
                validation_s=data.get("validation_s"), sanity_validation_s=data.get("sanity_validation_s"),
                compile=data.get("compile") or {}, marks=marks)


def compile_cache_env(root: Path) -> dict[str, str]:
    """Environment that puts a child's compile caches under ``root``: Inductor's (FX graph, AOT autograd,
    autotuning of Triton kernels), Triton's and the pack's (``lightning-perf``'s own settings; see
    docs/performance.md)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
            "LIGHTNING_PERF_CACHE_DIR": str(root)}


def child_result(out: Path, returncode: int, tail: str, elapsed: float) -> dict:
    """A child's row: its result file; where it failed or was killed after its window closed (the
    final save, teardown), the window's own record with a warning; else the error."""
    window = out.with_name(out.name + ".window")
    try:
        if not returncode and out.is_file():
            return dict(json.loads(out.read_text()), process_s=elapsed)
        if window.is_file():
            return dict(json.loads(window.read_text()), process_s=elapsed,
                        warning=f"rc={returncode} after the window: {tail[-1500:]}")
        return {"error": tail or "no result written", "process_s": elapsed}
    finally:
        window.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--recipes", default=None,
                   help="comma-separated names (default: the single-GPU recipes; with --smoke also gpt-1.3b-zero3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 60; --smoke: 4)")
    p.add_argument("--warmup", type=int, default=None, help="steps before the window (default 20; --smoke: 2)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no_checkpoint", action="store_true",
                   help="no checkpoint at all: skip timing one save, and take the recipe's own checkpoint "
                        "callbacks out (their save_last saves the whole training state when the fit ends)")
    p.add_argument("--no_validation", action="store_true",
                   help="skip the recipe's validation pass after the window (and the eval-mode compile it costs)")
    p.add_argument("--budget_s", type=float, default=None, help="start no further run after this many seconds")
    p.add_argument("--fsdp_compile_scope", choices=("block", "model"), default="block",
                   help="the FSDP baseline compiles each block or the whole model")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile the last N steps of each side's window and summarise the kernels and GPU idle "
                        "time (the window figures of such a run are not a measurement)")
    p.add_argument("--recipe_first", action="store_true", help="run the recipe before its baseline")
    p.add_argument("--child", choices=("recipe", "plain", "fsdp", "mp"))
    p.add_argument("--baselines", default="fsdp,mp",
                   help="a multi-GPU recipe's baselines: fsdp (Lightning FSDPStrategy), mp (Lightning "
                        "ModelParallelStrategy + FSDP2 + per-block compile), comma-separated; none: the recipe alone")
    p.add_argument("--baseline_batch", type=int, default=None, metavar="N",
                   help="sequences per GPU of the multi-GPU baselines (default: the recipe's sequences per step "
                        "over its GPUs), for a recipe whose batch the baseline cannot hold in memory; tokens/s "
                        "per GPU are compared either way")
    p.add_argument("--no_baseline", action="store_true", help="run the recipe side only (startup measurements)")
    p.add_argument("--warm_cache", action="store_true",
                   help="run each recipe a second time against the compile caches its first run filled, and report "
                        "both runs' startup and exit (the first run starts from empty caches)")
    p.add_argument("--cache_root", default=None,
                   help="where the children's compile caches go (one folder per side and recipe, emptied before "
                        "its first run); default: a temporary folder removed at the end")
    p.add_argument("--child_args", default="", help=argparse.SUPPRESS)
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also run each recipe with these CLI overrides, e.g. 'block=--model.compile_scope block'")
    if sys.argv[1:2] == ["fit"]:
        # a rank that Lightning's launcher started for a multi-GPU recipe: it re-runs the command line
        # that rank 0's CLI saw (``fit --config NAME ...``), with the window's settings in its environment
        from lightning_perf.cli import main as cli_main

        return cli_main(sys.argv[1:], command=True)
    args = p.parse_args()
    global _BASELINE_BATCH
    _BASELINE_BATCH = args.baseline_batch
    if args.recipes is None:
        args.recipes = "gpt2-124m,gpt-1.3b,gpt-1.3b-fp8" + (",gpt-1.3b-zero3" if args.smoke else "")
    if args.steps is None:
        args.steps = 4 if args.smoke else 60
    if args.warmup is None:
        args.warmup = 2 if args.smoke else 20
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.child is None:
        import tempfile

        cache_root = Path(args.cache_root or tempfile.mkdtemp(prefix="bench_recipes_cache_"))
    if args.no_checkpoint:
        os.environ["BENCH_WINDOW_CHECKPOINT"] = "0"
    if args.no_validation:
        os.environ["BENCH_NO_VALIDATION"] = "1"
    if args.profile:
        os.environ["BENCH_PROFILE_STEPS"] = str(args.profile)
    if args.child:
        name = args.recipes
        target = out_dir / f"_{args.child}-{name}.json"
        if args.child == "fsdp":
            run_fsdp(name, args.steps, args.warmup, target, args.smoke, args.child_args.split(),
                     compile_scope=args.fsdp_compile_scope)
        elif args.child == "mp":
            run_model_parallel(name, args.steps, args.warmup, target, args.smoke, args.child_args.split())
        elif args.child == "recipe":
            run_recipe(name, args.steps, args.warmup, target, args.smoke, args.child_args.split(), command=True)
        else:
            run_plain(name, args.steps, args.warmup, target, args.smoke, args.child_args.split())
        return

    import torch

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    kind = next((k for k in PEAK_BF16 if k in device_name.lower()), "cpu")
    rows: list = []
    plain_cache: dict = {}
    started = time.perf_counter()
    stamp = datetime.date.today().strftime("%Y%m%d")
    names = [n for n in args.recipes.split(",") if n]
    most = max(_devices(_recipe(n)) for n in names)
    device_tag = f"{most}x{kind}" if most > 1 and kind != "cpu" else kind  # the naming rule of benchmarks/README.md
    path = out_dir / f"bench_recipes_{device_tag}_{stamp}{'_' + args.tag if args.tag else ''}.json"

    def over_budget() -> bool:
        return args.budget_s is not None and time.perf_counter() - started > args.budget_s

    def write() -> None:
        path.write_text(json.dumps({
            "benchmark": "bench_recipes",
            "device": device_name,
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "steps": args.steps,
            "warmup": args.warmup,
            "headline": "tokens / wall-clock seconds over the timed window (mean)",
            "startup": "per run: seconds from process start to the end of the first training step, and from the "
                       "end of the last step to process exit (recipe: empty compile caches; recipe_warm: the "
                       "caches the first run filled)",
            "rows": rows,
        }, indent=2))

    gpus = torch.cuda.device_count()
    for name in names:  # refused before anything runs
        recipe = _recipe(name)
        if _devices(recipe) > 1:
            _fsdp_batch(recipe)
        if not args.smoke and _devices(recipe) > gpus:
            raise SystemExit(f"{name} asks for devices={_devices(recipe)}; this machine has {gpus} GPU(s)")
    for name in names:
        recipe = _recipe(name)
        cfg = _model_config(recipe)
        data = recipe.get("data") or {}
        seq_len = SMOKE_SEQ_LEN if args.smoke else int(data.get("seq_len", 1024))
        devices = _devices(recipe)
        bases = [] if args.no_baseline else (
            [b for b in args.baselines.split(",") if b and b != "none"] if devices > 1 else ["plain"])
        base = bases[0] if bases else None
        row: dict = {"name": name, "devices": devices, "baseline": base, "baselines": bases}
        rows.append(row)
        plain_key = json.dumps([dataclasses.asdict(_plain_config(recipe)), data.get("seq_len"), data.get("batch_size"),
                                (recipe.get("trainer") or {}).get("gradient_clip_val"), _schedule(recipe)],
                               default=str)
        for side in ((*bases, "recipe") if not args.recipe_first else ("recipe", *bases)):
            if over_budget():
                row[side] = {"error": "skipped: --budget_s reached"}
                continue
            if side == "plain" and plain_key in plain_cache:
                row[side] = dict(plain_cache[plain_key], same_as=plain_cache[plain_key]["recipe"])
                continue
            target = out_dir / f"_{side}-{name}.json"
            target.unlink(missing_ok=True)
            cache = fresh_cache(cache_root / f"{side}-{name}")
            row[side] = _child(side, name, args, target, cache=cache)
            if side == "plain" and "tokens_per_s" in row[side]:
                plain_cache[plain_key] = dict(row[side], recipe=name)
            target.unlink(missing_ok=True)
            print(f"[{name}] {side}: " + json.dumps({k: row[side].get(k) for k in
                  ("tokens_per_s", "step_ms_mean", "step_ms_median", "step_ms_p90", "peak_mem_gb", "peak_reserved_gb")}), flush=True)
            if "startup" in row[side]:
                print(f"[{name}] {side} startup (empty caches): {startup_line(row[side])}", flush=True)
            if side == "recipe" and args.warm_cache and not over_budget():
                row["recipe_warm"] = _child(side, name, args, target, cache=cache)
                target.unlink(missing_ok=True)
                print(f"[{name}] recipe startup (warm caches): {startup_line(row['recipe_warm'])}", flush=True)
        write()
        for spec in args.variant:
            label, _, extra = spec.partition("=")
            if over_budget():
                break
            target = out_dir / f"_recipe-{name}.json"
            target.unlink(missing_ok=True)
            result = _child("recipe", name, args, target, extra, cache=fresh_cache(cache_root / f"{label}-{name}"))
            target.unlink(missing_ok=True)
            result["args"] = extra
            for b in bases:
                if "tokens_per_s" in result and "tokens_per_s" in row[b]:
                    result[f"vs_{b}"] = result["tokens_per_s"] / row[b]["tokens_per_s"]
            row.setdefault("variants", {})[label] = result
            print(f"[{name}] variant {label}: " + json.dumps({k: result.get(k) for k in
                  ("tokens_per_s", *(f"vs_{b}" for b in bases), "step_ms_median", "step_ms_p90", "peak_mem_gb",
                   "peak_reserved_gb")}), flush=True)
        for b in bases:
            if "tokens_per_s" not in row[b] or "tokens_per_s" not in row["recipe"]:
                continue
            row[f"recipe_vs_{b}"] = row["recipe"]["tokens_per_s"] / row[b]["tokens_per_s"]
            print(f"[{name}] recipe / {b} = {row[f'recipe_vs_{b}']:.3f}", flush=True)
        if kind in PEAK_BF16 and not args.smoke:  # per GPU
            fpt = cfg.flops_per_token(seq_len)
            for side in (*bases, "recipe"):
                if "tokens_per_s" in row[side]:
                    row[f"mfu_{side}"] = fpt * row[side]["tokens_per_s"] / devices / PEAK_BF16[kind]
        write()
    write()
    if args.cache_root is None:
        import shutil

        shutil.rmtree(cache_root, ignore_errors=True)
    print(f"wrote {path}")


def fresh_cache(root: Path) -> Path:
    """``root`` emptied: a run starting from it compiles and tunes everything (a cold start)."""
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def startup_line(result: dict) -> str:
    """One line of a side's startup and exit: the headlines, then each span that was reached."""
    startup = result.get("startup") or {}
    shown = {k: v for k, v in startup.items() if k.endswith("_s") and v is not None}
    shown.update(startup.get("compile") or {})
    return json.dumps(shown) if shown else "no phase marks"


if __name__ == "__main__":
    main()
