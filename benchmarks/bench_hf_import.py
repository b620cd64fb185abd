"""A Hugging Face checkpoint through the fine-tuning recipe against the same recipe from scratch: does a
model imported with ``init_from_hf`` train as fast as one the pack initialised itself, and how long
does each take to start?

    python benchmarks/bench_hf_import.py --out $OUT                   # llama-1b-finetune on one GPU, 30 steps after 10
    python benchmarks/bench_hf_import.py --steps 60 --warmup 20 --tag long
    python benchmarks/bench_hf_import.py --batch_size 2 --tag b2       # an 80 GB GPU: half the recipe's batch
    python benchmarks/bench_hf_import.py --smoke                      # CPU: a tiny Llama, 3 steps, the same code path

One call does both sides on the same GPU:

1. ``transformers`` writes a random-weight ``LlamaForCausalLM`` of the preset's shape (``llama-1b``:
   16 layers, d 2048, 32 query and 8 key/value heads, SwiGLU 8192, vocabulary 128256, RoPE theta
   500000 without scaling, untied head) as bf16 safetensors (``save_pretrained``) into a temporary
   folder. The GPT config the pack reads from that folder must equal the preset's, field for field
   (the name aside), before anything trains;
2. the recipe (``llama-1b-finetune``) runs through the CLI entry point as ``bench_recipes.py`` runs a
   recipe (``bench_recipes.run_recipe``: LightningCLI, the recipe's precision, ZeRO-3 strategy with
   ``init: meta``, clipping, callbacks, synthetic tokens of the model's vocabulary, the window
   callback ``_timing.WallClockWindow``), twice, each in a fresh child process: ``hf`` with
   ``init_from_hf`` set to the folder, ``scratch`` with ``init_from_hf`` unset and the preset named
   instead (random init). The only override of the recipe beyond the data and step count is
   ``devices: 1``: ZeRO-3 (FSDP2) runs on a one-rank mesh, so the strategy stays the recipe's. On one
   GPU that rank holds the whole fp32 model, gradients and AdamW state (~24 GB at 1.5B parameters)
   beside the recipe's activations at 4 x 4096 tokens with full logits: a 141 GB H200 runs the
   recipe's batch, an 80 GB GPU may need ``--batch_size 2`` (both sides alike).

Per side: tokens / wall time over the window after warm-up (the mean step), the median and p90 step,
peak memory in the window and before the first step; and the start-up the user waits through:
``start_to_first_step_s`` (from the CLI call to the first training step: the module, the Trainer, the
model built on meta, sharded, filled from the checkpoint or drawn at random, the optimizer, the
sanity validation) and ``model_setup_s`` (Lightning's ``setup`` hook to ``on_fit_start``: build, shard,
load or initialise, optimizer). ``starts_from_checkpoint`` says whether the first block's key
projection held the checkpoint's values at the first step (it must be true for ``hf`` alone). The
folder was just written, so the ``hf`` side reads it from the page cache. The JSON
(``bench_hf_import_<device>_<date>.json`` under ``--out``) is rewritten after each side and holds
``hf_vs_scratch`` (tokens/s) and ``load_s_hf_minus_scratch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

RECIPE = "llama-1b-finetune"
PRESET = "llama-1b"
SIDES = ("scratch", "hf")
# the smoke's tiny Llama: the recipe's structure (GQA, untied head, RoPE theta), CPU-sized
SMOKE_PRESET = "tiny-llama"
SMOKE_SHAPE = {
    "vocab_size": 256,
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "n_kv_head": 2,
    "intermediate_size": 128,
    "rope_theta": 500000.0,
}
SMOKE_SEQ_LEN = 32
# the GPT tensor compared with the checkpoint at the first step, and its Hugging Face name
PROBE = ("blocks.0.attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight")


# ---- the checkpoint -----------------------------------------------------------------------------


def llama_config(cfg: Any) -> Any:
    """The ``transformers.LlamaConfig`` of a Llama-shaped :class:`GPTConfig`, field by field."""
    import inspect

    import transformers

    if (cfg.norm, cfg.activation, cfg.positions) != ("rmsnorm", "swiglu", "rope"):
        raise SystemExit(
            f"{cfg.name} is not Llama-shaped (norm={cfg.norm}, activation={cfg.activation}, "
            f"positions={cfg.positions})"
        )
    fields: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "initializer_range": cfg.init_std,
        "architectures": ["LlamaForCausalLM"],
    }
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if (
        "rope_parameters"
        in inspect.signature(transformers.LlamaConfig.__init__).parameters
    ):
        fields["rope_parameters"] = {
            **(scaling or {"rope_type": "default"}),
            "rope_theta": cfg.rope_theta,
        }
    else:  # transformers 4: two fields
        fields.update(rope_theta=cfg.rope_theta, rope_scaling=scaling)
    return transformers.LlamaConfig(**fields)


def write_random_llama(cfg: Any, folder: Path, seed: int = 0) -> dict[str, Any]:
    """A random-weight ``LlamaForCausalLM`` of ``cfg``'s shape saved by ``save_pretrained`` (bf16 safetensors)."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as err:
        raise SystemExit(
            f"this benchmark writes its checkpoint with transformers and safetensors: {err}"
        ) from err

    config = llama_config(cfg)
    t = time.perf_counter()
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    # built in bf16: half the host memory of an fp32 build and a cast
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(str(folder))
    params = sum(p.numel() for p in model.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    del model
    files = sorted(folder.glob("*.safetensors"))
    return {
        "build_and_save_s": time.perf_counter() - t,
        "parameters": params,
        "dtypes": dtypes,
        "files": [f.name for f in files],
        "bytes": sum(f.stat().st_size for f in files),
        "transformers": transformers.__version__,
    }


def check_same_shape(cfg: Any, folder: Path, overrides: dict[str, Any]) -> None:
    """Refuse, naming the fields, unless the folder's GPT config equals ``cfg`` (the name aside; the vocabulary
    padding compared by its padded size)."""
    from lightning_perf.models.gpt.hf import config_from_hf, read_hf_config

    imported = config_from_hf(read_hf_config(folder), **overrides)
    skip = {"name", "pad_vocab_multiple"}
    ours, theirs = dataclasses.asdict(cfg), dataclasses.asdict(imported)
    diff = {
        k: (ours[k], theirs[k]) for k in ours if k not in skip and ours[k] != theirs[k]
    }
    if cfg.padded_vocab_size != imported.padded_vocab_size:
        diff["padded_vocab_size"] = (cfg.padded_vocab_size, imported.padded_vocab_size)
    if diff:
        raise SystemExit(
            f"the checkpoint's GPT differs from {cfg.name} (preset, checkpoint): {diff}"
        )


# ---- a child: one side --------------------------------------------------------------------------


class StartUp(Callback):
    """Start-up times of a run and, at its first step, whether it starts from the checkpoint.

    ``BENCH_HF_T0``: ``time.perf_counter()`` when the CLI was called; ``BENCH_HF_CHECKPOINT``: the folder to
    compare with; ``BENCH_HF_OUT``: where the JSON goes (written at the first step).
    """

    def __init__(self) -> None:
        super().__init__()
        self.t0 = float(os.environ["BENCH_HF_T0"])
        self.folder = os.environ["BENCH_HF_CHECKPOINT"]
        self.out = os.environ["BENCH_HF_OUT"]
        self._setup: float | None = None
        self._fit: float | None = None
        self._done = False

    @staticmethod
    def _now(trainer: Any) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._setup = self._now(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._fit = self._now(trainer)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        self._done = True
        first = self._now(trainer)
        cuda = torch.cuda.is_available()
        result = {
            "start_to_first_step_s": first - self.t0,
            "model_setup_s": self._fit - self._setup,
            "peak_mem_gb_to_first_step": torch.cuda.max_memory_allocated() / 1e9
            if cuda
            else None,
            "starts_from_checkpoint": self._starts_from_checkpoint(pl_module),
        }
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(result, indent=2))

    def _starts_from_checkpoint(self, pl_module: Any) -> bool:
        from lightning_perf.models.gpt.hf import HFWeights

        name, key = PROBE
        param = next(
            p
            for n, p in pl_module.named_parameters()
            if n.replace("_orig_mod.", "").endswith(name)
        )
        # a sharded parameter gathered whole: on a one-rank mesh that moves nothing
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        stored = HFWeights(self.folder).get(key)
        return bool(torch.equal(value.detach().float().cpu(), stored.float()))


def run_side(side: str, args: argparse.Namespace, out: Path) -> None:
    """Child process: the recipe through ``lightning_perf.cli.main`` (``bench_recipes.run_recipe``)."""
    from bench_recipes import run_recipe

    _, scratch_overrides = _overrides(args)
    start_file = out.with_name(out.stem + "_start.json")
    os.environ.update(
        BENCH_HF_T0=str(time.perf_counter()),
        BENCH_HF_CHECKPOINT=args.hf_folder,
        BENCH_HF_OUT=str(start_file),
    )
    extra = [
        "--trainer.devices",
        "1",
        "--trainer.default_root_dir",
        str(out.parent / f"run-{args.recipe}-{side}"),
        "--trainer.callbacks+=bench_hf_import.StartUp",
    ]
    if side == "hf":
        extra += ["--model.init_from_hf", args.hf_folder]
    else:
        extra += [
            "--model.init_from_hf",
            "null",
            "--model.config",
            args.preset,
            "--model.config_overrides",
            json.dumps(scratch_overrides),
        ]
    if args.batch_size:
        extra += ["--data.batch_size", str(args.batch_size)]
    if args.smoke:
        extra += [
            "--trainer.accelerator",
            "cpu",
            "--data.seq_len",
            str(SMOKE_SEQ_LEN),
            "--data.num_workers",
            "0",
            "--trainer.limit_val_batches",
            "1",
        ]
    run_recipe(args.recipe, args.steps, args.warmup, out, False, extra)
    result = json.loads(out.read_text())
    result.update(json.loads(start_file.read_text()))
    out.write_text(json.dumps(result, indent=2))


def _overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The recipe's ``config_overrides`` (both sides), and the scratch side's: the shape, then the recipe's."""
    from bench_recipes import _recipe

    recipe = dict(
        (_recipe(args.recipe).get("model") or {}).get("config_overrides") or {}
    )
    return recipe, {**(SMOKE_SHAPE if args.smoke else {}), **recipe}


# ---- the parent ---------------------------------------------------------------------------------


def run_command(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in a fresh process and session (a timeout kills it and anything it started), output captured."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\ntimed out after {timeout}s"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _child(
    side: str, args: argparse.Namespace, folder: Path, out: Path, run: Callable
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        side,
        "--hf_folder",
        str(folder),
        "--recipe",
        args.recipe,
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        str(out.parent),
    ]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--batch_size", str(args.batch_size)] if args.batch_size else []
    cmd += ["--checkpoint"] if args.checkpoint else []
    t = time.perf_counter()
    proc = run(cmd, args.timeout)
    elapsed = time.perf_counter() - t
    if proc.returncode or not out.is_file():
        tail = proc.stdout[-1500:] + proc.stderr[-3000:]
        print(f"[{side}] failed (rc={proc.returncode}):\n{tail}", flush=True)
        return {"error": tail or "no result written", "process_s": elapsed}
    result = json.loads(out.read_text())
    result["process_s"] = elapsed
    return result


def main(argv: list[str] | None = None, run: Callable = run_command) -> Path:
    """The benchmark; ``run(cmd, timeout)`` runs each side's command line (a fresh process by default) and
    returns its ``subprocess.CompletedProcess``. Returns the JSON's path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--recipe", default=RECIPE)
    p.add_argument(
        "--preset",
        default=None,
        help=f"the scratch side's preset (default {PRESET}; --smoke: "
        f"{SMOKE_PRESET}, cut to a tiny shape)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps (default 30; --smoke: 2)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps before the window (default 10; --smoke: 1)",
    )
    p.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help="sequences per step on the GPU (default: the recipe's; both sides alike)",
    )
    p.add_argument("--timeout", type=int, default=1200, help="seconds per side")
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny Llama, 3 steps")
    p.add_argument(
        "--hf_first",
        action="store_true",
        help="run the hf side before the scratch side",
    )
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="also time one checkpoint save after each window",
    )
    p.add_argument("--child", choices=SIDES)
    p.add_argument("--hf_folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.preset = args.preset or (SMOKE_PRESET if args.smoke else PRESET)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        if not args.checkpoint:
            os.environ["BENCH_WINDOW_CHECKPOINT"] = "0"
        run_side(args.child, args, out_dir / f"_{args.child}.json")
        return out_dir / f"_{args.child}.json"

    from bench_recipes import _recipe

    from lightning_perf.models import GPTConfig

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --smoke for the code path on the CPU")
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    kind = next(
        (k for k in ("h100", "h200") if k in device.lower()),
        "cpu" if args.smoke else "gpu",
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    path = (
        out_dir
        / f"bench_hf_import_{kind}_{stamp}{'_' + args.tag if args.tag else ''}.json"
    )
    recipe_overrides, scratch_overrides = _overrides(args)
    data = _recipe(args.recipe).get("data") or {}
    cfg = GPTConfig.from_name(args.preset, **scratch_overrides)
    report: dict[str, Any] = {
        "benchmark": "bench_hf_import",
        "device": device,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "recipe": args.recipe,
        "preset": args.preset,
        "overrides": {"trainer.devices": 1, "data.source": "synthetic"},
        "steps": args.steps,
        "warmup": args.warmup,
        # the recipe's own, or "auto" (the memory planner's choice in the run, logged there)
        "batch_size": args.batch_size or data.get("batch_size", 8),
        "seq_len": SMOKE_SEQ_LEN if args.smoke else int(data.get("seq_len", 1024)),
        "headline": "tokens / wall-clock seconds over the timed window (mean); hf_vs_scratch = hf / scratch",
        "model": {
            k: getattr(cfg, k)
            for k in (
                "n_layer",
                "n_embd",
                "n_head",
                "n_kv_head",
                "intermediate_size",
                "vocab_size",
                "block_size",
                "rope_theta",
                "rope_scaling",
                "tie_embeddings",
            )
        },
        "parameters": cfg.num_params(),
    }

    def write() -> None:
        path.write_text(json.dumps(report, indent=2))

    folder = Path(tempfile.mkdtemp(prefix="hf-llama-", dir=out_dir))
    try:
        report["checkpoint"] = write_random_llama(cfg, folder)
        check_same_shape(cfg, folder, recipe_overrides)
        print(f"[checkpoint] {json.dumps(report['checkpoint'])}", flush=True)
        write()
        for side in SIDES[::-1] if args.hf_first else SIDES:
            target = out_dir / f"_{side}.json"
            target.unlink(missing_ok=True)
            report[side] = _child(side, args, folder, target, run)
            target.unlink(missing_ok=True)
            target.with_name(target.stem + "_start.json").unlink(missing_ok=True)
            print(
                f"[{side}] "
                + json.dumps(
                    {
                        k: report[side].get(k)
                        for k in (
                            "tokens_per_s",
                            "step_ms_mean",
                            "step_ms_median",
                            "step_ms_p90",
                            "peak_mem_gb",
                            "start_to_first_step_s",
                            "model_setup_s",
                            "starts_from_checkpoint",
                        )
                    }
                ),
                flush=True,
            )
            write()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    hf, scratch = report.get("hf", {}), report.get("scratch", {})
    if "tokens_per_s" in hf and "tokens_per_s" in scratch:
        report["hf_vs_scratch"] = hf["tokens_per_s"] / scratch["tokens_per_s"]
        report["load_s_hf_minus_scratch"] = (
            hf["start_to_first_step_s"] - scratch["start_to_first_step_s"]
        )
        print(
            f"hf / scratch = {report['hf_vs_scratch']:.3f}; start-up {hf['start_to_first_step_s']:.1f} s "
            f"against {scratch['start_to_first_step_s']:.1f} s",
            flush=True,
        )
    write()
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
