"""Short errors instead of usage texts and tracebacks: a mistyped option, bad input found while a run sets up.

A mistyped option gets the closest valid names (:class:`_ShortErrorParser`); an error the user can act
on (:func:`user_error_message`: the pack's error types, a ``ValueError`` the pack raised, a missing file,
a checkpoint that does not fit) is printed in a few lines with exit status 1, unless
``LIGHTNING_PERF_DEBUG=1`` or ``--debug`` asks for the traceback; an unknown strategy name and a
``--ckpt_path`` that is no checkpoint are refused before anything is built.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn, Optional

from lightning.pytorch.cli import LightningArgumentParser

from lightning_perf.cli.recipes import DEFAULT_RECIPE, _option_value


class _ShortErrorParser(LightningArgumentParser):
    """Errors in two or three lines: the problem, the closest option names, where to find the rest."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:  # type: ignore[override]
        if not getattr(self, "exit_on_error", True):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        sub = re.search(r"Subcommand '(\w+)'", str(message))
        if sub and parser is self:
            parser = _subcommand_parser(self, sub.group(1)) or self
        prog = parser.prog.replace(" [options]", "")
        lines = [f"{prog}: error: {_first_lines(message)}"]
        hint = _did_you_mean(message, _option_names(parser))
        if hint:
            lines.append(hint)
        lines.append(f"(all options: {prog} --help)")
        sys.stderr.write("\n".join(lines) + "\n")
        raise SystemExit(2)


def _subcommand_parser(parser: Any, name: str) -> Any:
    for action in getattr(parser, "_actions", []):
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and name in choices:
            return choices[name]
    return None


def _first_lines(message: str, limit: int = 6) -> str:
    lines = [line for line in str(message).splitlines() if line.strip()]
    return "\n  ".join(lines[:limit]) + ("\n  ..." if len(lines) > limit else "")


def _option_names(parser: Any) -> list[str]:
    names: list[str] = []
    for action in getattr(parser, "_actions", []):
        for opt in getattr(action, "option_strings", []):
            if opt.startswith("--") and not opt.endswith(".help"):
                names.append(opt[2:])
    return names


def _did_you_mean(message: str, known: list[str]) -> str:
    """Close matches for the dotted keys that ``message`` names ('trainer.max_step', --trainer.stratgy)."""
    named = re.findall(r"[\"'](\w+(?:\.\w+)+)[\"']", message) + re.findall(r"--(\w+(?:\.\w+)+)", message)
    suggestions = []
    for key in dict.fromkeys(named):
        if key in known:
            continue
        prefix = key.rsplit(".", 1)[0] + "."
        pool = [k for k in known if k.startswith(prefix)] or known
        close = difflib.get_close_matches(key, pool, n=2, cutoff=0.6)
        if close:
            suggestions.append(f"{key} -> did you mean {' or '.join(close)}?")
    return "\n".join(suggestions)


DEBUG_ENV = "LIGHTNING_PERF_DEBUG"
_DEBUG_HINT = f"(for the traceback: {DEBUG_ENV}=1 or --debug)"
_PACK_DIR = Path(__file__).resolve().parent.parent  # lightning_perf/
# Lightning's special values of --ckpt_path (resolved by the Trainer, not files)
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")


def _pop_debug(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug``, and whether the traceback was asked for (flag or environment)."""
    debug = "--debug" in args
    if debug:
        os.environ[DEBUG_ENV] = "1"  # ranks a launcher starts inherit it
    on = debug or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return [a for a in args if a != "--debug"], on


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    todo: list[Optional[BaseException]] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
    return seen


def _raised_in_pack(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(_PACK_DIR)


def _load_mismatch(err: BaseException, args: list[str]) -> Optional[str]:
    """For a checkpoint that does not fit the model, the first offending tensor (from wherever in the
    chain of exceptions it was reported) and what to do; None for any other error."""
    ckpt = _option_value(args, "ckpt_path")
    if ckpt is None:  # only a checkpoint that is loaded can misfit
        return None
    pattern = re.compile(r"size mismatch|missing key|unexpected key", re.I)
    for e in _chain(err):
        lines = [line.strip() for line in str(e).splitlines() if pattern.search(line)]
        if not lines:
            continue
        first = lines[0]
        if first.lower().startswith(("missing key", "unexpected key")) and len(first) > 240:
            first = first[:240] + " ..."
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        return (
            f"--ckpt_path {ckpt} does not fit this model: {first}{more}\n"
            "build the model as the checkpoint was trained (the same --model.config and "
            "--model.config_overrides), or leave out --ckpt_path"
        )
    return None


def _pack_error_types() -> tuple[type, ...]:
    from lightning_perf.callbacks.nonfinite import NonFiniteError
    from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointError
    from lightning_perf.parallel.checkpointing.checkpoint import CheckpointCorruptError
    from lightning_perf.parallel.reliability.watchdog import CollectiveTimeoutError, RankFailureError

    return (CheckpointCorruptError, AsyncCheckpointError, NonFiniteError, RankFailureError, CollectiveTimeoutError)


def user_error_message(err: BaseException, args: Optional[list[str]] = None) -> Optional[str]:
    """The message of an error the user can act on (bad input, a file that is missing or does not fit),
    or None for one whose traceback is needed (a bug).

    User errors: the pack's own error types, a ``ValueError`` the pack raised, Lightning's
    ``MisconfigurationException``, a missing or unreadable file, an optional extra that is not
    installed, and a checkpoint whose tensors do not fit the model (named from the innermost cause).
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    mismatch = _load_mismatch(err, list(args or []))
    if mismatch is not None:
        return mismatch
    if isinstance(err, _pack_error_types()) or isinstance(err, MisconfigurationException):
        return str(err)
    if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return str(err)
    if isinstance(err, ValueError) and _raised_in_pack(err):
        return str(err)
    if isinstance(err, ImportError) and "pip install" in str(err):
        return str(err)
    return None


def _exit_on_user_error(err: BaseException, args: list[str]) -> None:
    """Print a user error in a few lines and exit 1; return (for the caller to re-raise) otherwise."""
    message = user_error_message(err, args)
    if message is None or not message.strip():
        return
    sub = args[0] if args and not args[0].startswith("-") else ""
    prog = f"lightning-perf {sub}".strip()
    sys.stderr.write(f"{prog}: error: {_first_lines(message, limit=2)}\n{_DEBUG_HINT}\n")
    raise SystemExit(1)


def _check_strategy_name(strategy: Any, prog: str = "lightning-perf") -> None:
    """A strategy name Lightning would reject, refused here with the names that exist."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_perf.strategies import STRATEGY_NAMES

    if not isinstance(strategy, str) or strategy == "auto" or strategy in StrategyRegistry:
        return
    ours = sorted(STRATEGY_NAMES)
    names = list(dict.fromkeys([*ours, *StrategyRegistry.available_strategies()]))
    close = difflib.get_close_matches(strategy, names, n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise SystemExit(
        f"{prog}: error: unknown strategy {strategy!r}.{hint}\n"
        f"The pack's strategies: {', '.join(ours)}; Lightning's: auto, ddp, fsdp, deepspeed, ... "
        "(or a class_path with init_args, e.g. lightning_perf.strategies.Parallel3DStrategy)"
    )


def _check_model_preset(config: Any, prog: str = "lightning-perf") -> None:
    """A ``--model.config`` preset name that does not exist, refused with the closest names before the
    module is built."""
    from lightning_perf.models.gpt.config import PRESETS

    if not isinstance(config, str) or config.lower() in PRESETS:
        return
    names = sorted(PRESETS)
    close = difflib.get_close_matches(config.lower(), names, n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise SystemExit(
        f"{prog}: error: --model.config {config}: no GPT preset of that name.{hint}\n"
        f"The presets: {', '.join(names)}"
    )


def _check_accelerator(accelerator: Any, prog: str = "lightning-perf") -> None:
    """``trainer.accelerator`` gpu / cuda on a machine without one, refused with the two ways to run on the
    CPU instead of Lightning's ``No supported gpu backend found!``."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    name = str(accelerator).lower() if isinstance(accelerator, str) else None
    if name not in ("gpu", "cuda") or CUDAAccelerator.is_available():
        return
    if name == "gpu" and MPSAccelerator.is_available():
        return
    raise SystemExit(
        f"{prog}: error: trainer.accelerator is {accelerator!r} and this machine has no GPU torch can use.\n"
        f"Add --trainer.accelerator cpu (a GPU recipe's GPU-only settings then switch to CPU ones), or train the "
        f"CPU recipe: {prog} --config {DEFAULT_RECIPE}"
    )


def _check_ckpt_path(ckpt_path: Any) -> None:
    """Refuse a ``--ckpt_path`` that is no checkpoint before the Trainer reads it (torch's unpickler
    fails on such a file with e.g. ``KeyError: 101``)."""
    if not isinstance(ckpt_path, (str, os.PathLike)) or str(ckpt_path) in _CKPT_KEYWORDS or "://" in str(ckpt_path):
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(
            f"--ckpt_path {path}: no such file or directory (pass a checkpoint that `fit` wrote, e.g. "
            "<default_root_dir>/checkpoints/last.ckpt, or 'last')"
        )
    if path.is_file() and not _is_torch_file(path):
        raise ValueError(
            f"--ckpt_path {path}: not a checkpoint (not a file written by torch.save, or a truncated one); pass "
            "a .ckpt that `fit` wrote or a sharded checkpoint directory"
        )


def _is_torch_file(path: Path) -> bool:
    """Whether ``path`` is a complete ``torch.save`` archive (or the legacy pickle format)."""
    import zipfile

    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"  # torch's legacy (non-zip) format starts with a protocol-2 pickle
