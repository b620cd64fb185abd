"""The ``lightning-perf`` command: LightningCLI (fit / validate / test / predict) plus generate, prepare, consolidate.

    lightning-perf fit                                   # the tiny GPT on the built-in corpus (CPU)
    lightning-perf fit --config configs/gpt2-124m.yaml   # any recipe; flags override it
    lightning-perf generate --ckpt_path last.ckpt --prompt "def main("
    lightning-perf prepare --input my_texts/ --out_dir data/mine
    lightning-perf consolidate --ckpt_dir ckpts/step=100 --out model.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import lightning_perf  # noqa: F401  (registers the strategy names)
from lightning_perf.data import TokenDataModule
from lightning_perf.models.gpt.module import GPTLightningModule

__all__ = ["main", "default_config_path", "load_module"]

DEFAULT_CONFIG = "gpt-tiny-cpu.yaml"


def default_config_path() -> Optional[Path]:
    """The embedded default recipe, ``configs/gpt-tiny-cpu.yaml`` of the source tree (editable install)."""
    candidate = Path(__file__).resolve().parent.parent / "configs" / DEFAULT_CONFIG
    return candidate if candidate.is_file() else None


_DESCRIPTION = (
    "lightning_perf: train, validate, test and predict with the GPT (LightningCLI; "
    "`fit` defaults to configs/gpt-tiny-cpu.yaml). Also: `generate --ckpt_path ... --prompt ...`, "
    "`prepare --input ... --out_dir ...`, `consolidate --ckpt_dir ... --out ...` (each with --help)."
)


def _run_lightning_cli(argv: Optional[list[str]]) -> None:
    default = default_config_path()
    sub_kwargs = {"default_config_files": [str(default)]} if default is not None else {}
    parser_kwargs: dict = {sub: dict(sub_kwargs) for sub in ("fit", "validate", "test", "predict")}
    parser_kwargs["description"] = _DESCRIPTION
    LightningCLI(
        GPTLightningModule,
        TokenDataModule,
        args=argv,  # None: read sys.argv, as a console script should
        parser_kwargs=parser_kwargs,
        save_config_kwargs={"overwrite": True},
    )


def _generate(argv: list[str]) -> None:
    import torch

    from lightning_perf.data import ByteTokenizer

    p = argparse.ArgumentParser(prog="lightning-perf generate", description="Sample text from a checkpoint")
    p.add_argument("--ckpt_path", required=True, help="a Lightning .ckpt file or a consolidated .pt file")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    module = load_module(args.ckpt_path, map_location=args.device)
    tok = ByteTokenizer()
    if module.config.vocab_size < tok.vocab_size:
        raise SystemExit(
            f"this model's vocabulary ({module.config.vocab_size}) is not the byte tokenizer's ({tok.vocab_size}): "
            "generate supports byte-level models"
        )
    ids = tok.encode(args.prompt, bos=True)
    idx = torch.tensor([list(ids)], dtype=torch.long, device=args.device)
    out = module.generate(
        idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, eos_id=tok.eos_id, seed=args.seed
    )
    print(tok.decode(out[0].tolist()))


def load_module(ckpt_path: str, map_location: str = "cpu") -> GPTLightningModule:
    """Load a GPTLightningModule from a Lightning checkpoint file or a consolidated state file."""
    import torch

    path = Path(ckpt_path)
    if not path.exists():
        raise SystemExit(f"checkpoint not found: {path}")
    if path.is_dir():
        raise SystemExit(
            f"{path} is a sharded (distributed) checkpoint directory: run "
            f"`lightning-perf consolidate --ckpt_dir {path} --out model.pt` first and pass model.pt"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # truncated file, not a checkpoint, or a pickled object we refuse to run
        raise SystemExit(f"cannot load checkpoint {path}: {err}") from err
    hparams = ckpt.get("hyper_parameters") or {}
    if "config" not in hparams:
        raise SystemExit(f"{path} holds no GPT config under 'hyper_parameters': not a lightning_perf checkpoint")
    # the CLI adds private keys (e.g. its instantiator) that are no constructor arguments
    module = GPTLightningModule(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    module.configure_model()
    state = ckpt["state_dict"]
    module.load_state_dict(state, strict=False)
    missing = [k for k in module.state_dict() if k.startswith("model.") and k not in state]
    if missing:
        raise SystemExit(f"{path} lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    return module.to(map_location).eval()


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "generate":
        return _generate(args[1:])
    if args and args[0] == "prepare":
        from lightning_perf.data.prepare import main as prepare_main

        return prepare_main(args[1:])
    if args and args[0] == "consolidate":
        from lightning_perf.parallel.checkpoint import main as consolidate_main

        return consolidate_main(args[1:])
    _run_lightning_cli(argv)


if __name__ == "__main__":
    main()
