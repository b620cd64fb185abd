"""``lightning-perf convert``: Hugging Face checkpoint folders <-> the pack's checkpoints.

    lightning-perf convert --from_hf hf/Llama-3.2-1B --out llama-1b.ckpt    # weights for generate
    lightning-perf convert --to_hf last.ckpt --out hf/my-model               # a Lightning .ckpt
    lightning-perf convert --to_hf ckpts/step=100 --out hf/my-model          # a sharded checkpoint directory
    lightning-perf convert --to_hf model.pt --config gpt2-124m --out hf/m    # a consolidated state dict

Fine-tuning needs no conversion: ``--model.init_from_hf <folder>`` starts ``fit`` from the folder.
The ``.ckpt`` written here holds weights and hyper-parameters (no optimizer state): ``generate``
takes it as ``--ckpt_path``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import lightning
import torch

from lightning_perf.models.gpt.config import GPTConfig
from lightning_perf.models.gpt.hf import save_hf
from lightning_perf.models.gpt.module import GPTLightningModule
from lightning_perf.parallel.checkpointing.checkpoint import (
    consolidated_state_dict,
    read_consolidated_hparams,
    read_extra,
)
from lightning_perf.parallel.checkpointing.checkpoint_io import torch_load_weights

__all__ = ["checkpoint_to_hf", "hf_to_checkpoint", "main", "pack_state_and_config"]


def hf_to_checkpoint(hf_dir: Union[str, Path], out_file: Union[str, Path], **module_kwargs: Any) -> Path:
    """A Lightning checkpoint file (``state_dict`` + ``hyper_parameters``) of the Hugging Face folder."""
    module = GPTLightningModule.from_hf(hf_dir, **module_kwargs)
    module.configure_model()
    hparams = dict(module.hparams)
    hparams["init_from_hf"] = None  # the weights are in this file now
    ckpt = {
        "state_dict": {k: v for k, v in module.state_dict().items() if k.startswith("model.")},
        "hyper_parameters": hparams,
        "pytorch-lightning_version": lightning.__version__,
        "epoch": 0,
        "global_step": 0,
    }
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, out)
    return out


def _lightning_dict(extra: dict[str, Any]) -> dict[str, Any]:
    nested = extra.get("lightning")
    return nested if len(extra) == 1 and isinstance(nested, dict) else extra


def pack_state_and_config(
    path: Union[str, Path], config: Union[str, GPTConfig, None] = None
) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """The GPT's whole state dict and config from a Lightning ``.ckpt``, a sharded checkpoint directory
    (consolidated in memory) or a consolidated ``.pt`` (its config from the ``.pt.json`` that ``consolidate``
    writes beside it; without one, give ``config``)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if p.is_dir():
        hparams = _lightning_dict(read_extra(p).get("extra") or {}).get("hyper_parameters") or {}
        state = consolidated_state_dict(p)
    else:
        ckpt = torch_load_weights(p, map_location="cpu")
        if "state_dict" in ckpt:
            hparams = ckpt.get("hyper_parameters") or {}
            state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
        else:  # a consolidated state dict: its hyper-parameters, if recorded, lie beside it
            hparams, state = read_consolidated_hparams(p) or {}, ckpt
    if isinstance(config, str):
        config = GPTConfig.from_name(config)
    if config is None:
        if "config" not in hparams:
            raise ValueError(f"{p} records no GPT config: name the preset it was trained from (--config NAME)")
        config = GPTConfig(**hparams["config"])
    state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
    return state, config


def checkpoint_to_hf(
    path: Union[str, Path], out_dir: Union[str, Path], *, config: Union[str, GPTConfig, None] = None,
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """A Hugging Face folder (``config.json`` + ``model.safetensors``) of a pack checkpoint."""
    state, cfg = pack_state_and_config(path, config)
    return save_hf(state, cfg, out_dir, dtype=dtype)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``lightning-perf convert``."""
    p = argparse.ArgumentParser(
        prog="lightning-perf convert",
        description="Convert a Hugging Face checkpoint folder to a Lightning .ckpt, or a pack checkpoint "
        "(.ckpt, sharded directory, consolidated .pt) to a Hugging Face folder.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from_hf", help="a Hugging Face folder (config.json + safetensors)")
    source.add_argument("--to_hf", help="a .ckpt file, a sharded checkpoint directory or a consolidated .pt")
    p.add_argument("--out", required=True, help="the .ckpt file (--from_hf) or the folder (--to_hf) to write")
    p.add_argument("--config", default=None, help="--to_hf of a consolidated .pt without its .pt.json: the GPT preset")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="--to_hf: tensor dtype (default: as saved)")
    args = p.parse_args(argv)
    try:
        if args.from_hf:
            out = hf_to_checkpoint(args.from_hf, args.out)
        else:
            out = checkpoint_to_hf(args.to_hf, args.out, config=args.config, dtype=_DTYPES.get(args.dtype))
    except (FileNotFoundError, KeyError, ValueError, ImportError) as err:
        p.error(str(err))
    print(f"lightning-perf convert: wrote {out}")
