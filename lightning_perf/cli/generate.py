"""``lightning-perf generate``: sample text from a checkpoint, and :func:`load_module`, which loads one.

A Lightning ``.ckpt``, a consolidated state dict (with the hyper-parameters ``consolidate`` writes
beside it) or a Hugging Face folder; sampling arguments torch would fail on are refused first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_perf.cli.errors import _is_torch_file
from lightning_perf.models.gpt.module import GPTLightningModule


def _generate(argv: list[str]) -> None:
    import torch

    p = argparse.ArgumentParser(prog="lightning-perf generate", description="Sample text from a checkpoint")
    p.add_argument("--ckpt_path", required=True, help="a Lightning .ckpt file or a Hugging Face checkpoint folder")
    p.add_argument(
        "--tokenizer", default=None,
        help="'byte' or a folder holding tokenizer.json (default: the Hugging Face folder's, else byte)",
    )
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (always the likeliest token); >= 0")
    p.add_argument("--top_k", type=_optional_int, default=50, help="sample among the k likeliest tokens (>= 1), "
                   "or none for the whole vocabulary")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    _check_sampling_args(p, args)
    from lightning_perf.data import load_tokenizer

    path = Path(args.ckpt_path)
    hf_folder = path.is_dir() and (path / "config.json").is_file()
    if hf_folder:
        module = GPTLightningModule.from_hf(path).to(args.device).eval()
    else:
        module = load_module(args.ckpt_path, map_location=args.device)
    spec = args.tokenizer
    if spec is None:
        spec = path if hf_folder and (path / "tokenizer.json").is_file() else "byte"
    tok = load_tokenizer(spec)  # its errors (no such folder, a missing extra) are the command's short errors
    if module.config.vocab_size < tok.vocab_size:
        raise ValueError(
            f"this model's vocabulary ({module.config.vocab_size}) is smaller than the tokenizer's "
            f"({tok.vocab_size}, {tok.name}): pass the model's own with --tokenizer"
        )
    ids = tok.encode(args.prompt, bos=True)
    if not ids:
        raise ValueError("the tokenizer has no begin-of-text token: give a --prompt")
    idx = torch.tensor([list(ids)], dtype=torch.long, device=args.device)
    out = module.generate(
        idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, eos_id=tok.eos_id, seed=args.seed
    )
    print(tok.decode(out[0].tolist()))


def _is_sharded_checkpoint(path: Path) -> bool:
    """Whether the directory ``path`` holds a distributed checkpoint (torch.distributed.checkpoint's
    ``.metadata``, or the pack's layout)."""
    from lightning_perf.parallel.checkpointing.checkpoint import is_checkpoint

    return (path / ".metadata").is_file() or is_checkpoint(path)


def _optional_int(value: str) -> Optional[int]:
    return None if value.strip().lower() in ("none", "null") else int(value)


def _check_sampling_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse sampling arguments torch would fail on (or silently reinterpret), before anything loads."""
    import math

    problem = None
    if args.top_k is not None and args.top_k < 1:
        problem = f"--top_k must be >= 1 (or none: no top-k cut), got {args.top_k}"
    elif not math.isfinite(args.temperature) or args.temperature < 0:
        problem = f"--temperature must be a finite number >= 0 (0: greedy decoding), got {args.temperature}"
    elif args.max_new_tokens < 0:
        problem = f"--max_new_tokens must be >= 0, got {args.max_new_tokens}"
    if problem is not None:
        sys.stderr.write(f"{parser.prog}: error: {problem}\n(all options: {parser.prog} --help)\n")
        raise SystemExit(2)


def _with_consolidated_hparams(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """A consolidated state dict (``lightning-perf consolidate``) as a checkpoint: its weights under the
    module's ``model.`` and the hyper-parameters recorded beside it."""
    from lightning_perf.parallel.checkpointing.checkpoint import consolidated_hparams_path, read_consolidated_hparams

    hparams = read_consolidated_hparams(path)
    if hparams is None:
        raise ValueError(
            f"{path} is a consolidated state dict without {consolidated_hparams_path(path).name} (the GPT config "
            "that `lightning-perf consolidate` writes beside it): re-run consolidate on the sharded checkpoint"
        )
    return {"state_dict": {f"model.{k}": v for k, v in state.items()}, "hyper_parameters": hparams}


def load_module(ckpt_path: str, map_location: str = "cpu") -> GPTLightningModule:
    """Load a GPTLightningModule from a Lightning checkpoint file or a consolidated state file.

    Raises ``FileNotFoundError`` for a path that does not exist and ``ValueError`` for one that is no such
    checkpoint, each saying what to pass instead (``lightning-perf generate`` prints them as its errors)."""
    import torch

    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint not found: {path} (pass a .ckpt that `fit` wrote, e.g. runs/<recipe>/checkpoints/last.ckpt)"
        )
    if path.is_dir() and not _is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is a directory but no checkpoint: pass a .ckpt file, a consolidated model.pt or a Hugging "
            "Face folder (with config.json)"
        )
    if path.is_dir():
        raise ValueError(
            f"{path} is a sharded (distributed) checkpoint directory: run "
            f"`lightning-perf consolidate --ckpt_dir {path} --out model.pt` first and pass model.pt"
        )
    if not _is_torch_file(path):
        raise ValueError(f"cannot load checkpoint {path}: not a file written by torch.save (or a truncated one)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # truncated file, not a checkpoint, or a pickled object we refuse to run
        raise ValueError(f"cannot load checkpoint {path}: {err}") from err
    if isinstance(ckpt, dict) and "state_dict" not in ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        ckpt = _with_consolidated_hparams(path, ckpt)
    hparams = ckpt.get("hyper_parameters") or {}
    if "config" not in hparams:
        raise ValueError(f"{path} holds no GPT config under 'hyper_parameters': not a lightning_perf checkpoint")
    # the CLI adds private keys (e.g. its instantiator) that are no constructor arguments
    # the checkpoint's weights replace any Hugging Face initialisation: that folder is not read again
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_") and k != "init_from_hf"}
    module = GPTLightningModule(**kwargs)
    module.configure_model()
    state = ckpt["state_dict"]
    module.load_state_dict(state, strict=False)
    missing = [k for k in module.state_dict() if k.startswith("model.") and k not in state]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    return module.to(map_location).eval()
