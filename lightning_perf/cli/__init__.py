"""The ``lightning-perf`` command: LightningCLI (fit / validate / test / predict) plus generate, prepare, consolidate.

    lightning-perf fit                                   # the gpt-tiny-cpu recipe (tiny GPT, built-in corpus, CPU)
    lightning-perf fit --config gpt2-124m                # a recipe shipped with the package, by name
    lightning-perf fit --config my_recipe.yaml           # or a file; flags override either
    lightning-perf generate --ckpt_path last.ckpt --prompt "def main("
    lightning-perf prepare --input my_texts/ --out_dir data/mine
    lightning-perf consolidate --ckpt_dir ckpts/step=100 --out model.pt
    lightning-perf convert --from_hf hf/Llama-3.2-1B --out llama.ckpt    # or --to_hf last.ckpt --out hf/mine

What the CLI adds to Lightning's:

- ``--config NAME`` finds the recipes in ``lightning_perf/configs/``; with no ``--config`` the
  default recipe applies, and only then.
- ``trainer.precision`` becomes a :class:`~lightning_perf.plugins.PerfPrecision` on the
  single-device and DDP strategies as it already does on the pack's, so gradient clipping works
  with the fused AdamW (Lightning's mixed-precision plugin refuses that combination).
- Paths a recipe puts under its ``trainer.default_root_dir`` (logger ``save_dir``, checkpoint
  ``dirpath``) follow ``--trainer.default_root_dir`` when it is overridden.
- A mistyped option gets a short error with the closest valid names instead of the usage text.
- Bad input found while a run sets up (a missing file, a layout or checkpoint that does not fit, a
  ``ValueError`` of the pack) is printed in a few lines naming the file or option and the fix, exit
  status 1; ``LIGHTNING_PERF_DEBUG=1`` or ``--debug`` keeps the traceback.
- ``--trainer.accelerator cpu`` on a GPU recipe switches its compile modes, half precision and loader
  workers to CPU settings (one printed line); ``--config NAME --help`` shows the recipe's values.
- ``--ckpt_path last`` never starts over silently: see :func:`lightning_perf.runtime.resume.resume_path`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn, Optional

from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_perf  # noqa: F401  (registers the strategy names)
from lightning_perf.data import TokenDataModule
from lightning_perf.models.gpt.module import GPTLightningModule

__all__ = ["main", "recipe_dir", "recipe_names", "resolve_recipe", "default_config_path", "load_module"]

DEFAULT_RECIPE = "gpt-tiny-cpu"
_LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_OWN_SUBCOMMANDS = {
    "generate": "sample text from a checkpoint (--ckpt_path, --prompt)",
    "prepare": "tokenize text files into train.bin / val.bin for source: memmap (--input, --out_dir)",
    "consolidate": "turn a sharded checkpoint directory into one model.pt (--ckpt_dir, --out)",
    "convert": "Hugging Face folder <-> checkpoint (--from_hf DIR or --to_hf CKPT, --out)",
}


def recipe_dir() -> Path:
    """The folder of the recipes shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "configs"


def recipe_names() -> list[str]:
    """Names accepted by ``--config NAME``: the shipped recipes, without ``.yaml``."""
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def resolve_recipe(value: str) -> Path:
    """``value`` as a file if it is one, else the shipped recipe of that name; a clear error otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    name = path.name[: -len(".yaml")] if path.name.endswith(".yaml") else path.name
    shipped = recipe_dir() / f"{name}.yaml"
    if str(path.parent) in (".", "configs") and shipped.is_file():
        return shipped
    names = recipe_names()
    close = difflib.get_close_matches(name, names, n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise SystemExit(
        f"lightning-perf: --config {value}: no such file and no shipped recipe of that name.{hint}\n"
        f"Shipped recipes: {', '.join(names)}"
    )


def default_config_path() -> Path:
    """The recipe ``fit`` (and validate / test / predict) run when no ``--config`` is given."""
    return recipe_dir() / f"{DEFAULT_RECIPE}.yaml"


def _with_resolved_config(args: list[str]) -> list[str]:
    """Resolve every ``--config`` of a Lightning subcommand; add the default recipe when there is none."""
    if not args or args[0] not in _LIGHTNING_SUBCOMMANDS:
        return args
    out, given, i = [args[0]], False, 1
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args):
            out += [arg, str(resolve_recipe(args[i + 1]))]
            given, i = True, i + 2
            continue
        if arg.startswith("--config="):
            out.append("--config=" + str(resolve_recipe(arg.split("=", 1)[1])))
            given = True
        else:
            out.append(arg)
        i += 1
    if not given:
        out[1:1] = ["--config", str(default_config_path())]
    return out


# ---- precision -------------------------------------------------------------------------------


def _takes_generic_precision(strategy: Any) -> bool:
    """Whether ``strategy`` (a name, an instance, or None) runs with a generic precision plugin."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, StrategyRegistry

    from lightning_perf.strategies import PerfParallelStrategy

    if strategy is None or strategy == "auto":
        return True
    if isinstance(strategy, str):
        entry = dict.get(StrategyRegistry, strategy)  # the registry's own .get() builds an instance
        if entry is None:
            return False
        cls = entry["strategy"]
    else:
        cls = type(strategy)
    # DeepSpeed derives from DDP but brings its own precision plugin
    return issubclass(cls, (SingleDeviceStrategy, DDPStrategy, PerfParallelStrategy)) and not issubclass(
        cls, DeepSpeedStrategy
    )


def perf_precision_for(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments that swap ``precision=...`` for the matching ``PerfPrecision`` plugin.

    Empty when nothing should change: no precision asked for, a precision plugin already given,
    a strategy that needs its own plugin (Lightning's FSDP or DeepSpeed), or a precision that
    ``PerfPrecision`` does not have (it then stays Lightning's to resolve).
    """
    from lightning.pytorch.plugins.precision import Precision

    from lightning_perf.plugins import PerfPrecision
    from lightning_perf.plugins.precision import PRECISIONS, normalize_precision

    precision = trainer_config.get("precision")
    plugins = trainer_config.get("plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if precision is None or any(isinstance(p, Precision) for p in plugins):
        return {}
    if not _takes_generic_precision(trainer_config.get("strategy")):
        return {}
    precision = normalize_precision(precision)
    if precision not in PRECISIONS:
        return {}
    return {"precision": None, "plugins": [*plugins, PerfPrecision(precision)]}


# ---- paths that follow the run's root ---------------------------------------------------------


def _rebase(path: Any, old_root: Path, new_root: Path) -> Any:
    if path is None:
        return None
    p = Path(str(path))
    try:
        rel = p.relative_to(old_root)
    except ValueError:
        return path
    return str(new_root / rel)


def _recipe_root(config: Any) -> Optional[Path]:
    """``trainer.default_root_dir`` as the (last) recipe file states it."""
    import yaml

    files = [Path(str(c)) for c in (config.get("config") or []) if c is not None]
    root = None
    for f in files:
        try:
            data = yaml.safe_load(Path(str(f)).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        root = (data.get("trainer") or {}).get("default_root_dir", root)
    return None if root is None else Path(str(root))


def _follow_root(config: Any) -> None:
    """Move a recipe's logger / checkpoint directories with an overridden ``default_root_dir``."""
    trainer = config.get("trainer")
    if trainer is None or trainer.get("default_root_dir") is None:
        return
    old, new = _recipe_root(config), Path(str(trainer.get("default_root_dir")))
    if old is None or old == new:
        return
    loggers = trainer.get("logger")
    for entry in loggers if isinstance(loggers, list) else [loggers]:
        args = getattr(entry, "init_args", None)
        if args is not None and args.get("save_dir") is not None:
            args["save_dir"] = _rebase(args["save_dir"], old, new)
    for entry in trainer.get("callbacks") or []:
        args = getattr(entry, "init_args", None)
        if args is not None and args.get("dirpath") is not None:
            args["dirpath"] = _rebase(args["dirpath"], old, new)


def _check_strategy_name(strategy: Any) -> None:
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
        f"lightning-perf: unknown strategy {strategy!r}.{hint}\n"
        f"The pack's strategies: {', '.join(ours)}; Lightning's: auto, ddp, fsdp, deepspeed, ... "
        "(or a class_path with init_args, e.g. lightning_perf.strategies.Parallel3DStrategy)"
    )


# ---- errors ----------------------------------------------------------------------------------


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


# ---- errors a user can act on: a short message instead of a traceback ---------------------------

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


def _option_value(args: list[str], name: str) -> Optional[str]:
    """The value of ``--name V`` / ``--name=V`` on a command line (the last one), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


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


# ---- the CLI ---------------------------------------------------------------------------------


class PerfCLI(LightningCLI):
    """LightningCLI with the pack's precision rule, root-following paths and short errors."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = _ShortErrorParser(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ActionConfigFile, help="a recipe name or YAML file (see lightning-perf --help)"
        )
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        sub = self.config.get("subcommand")
        if sub:  # before LightningCLI reads the checkpoint's hyper-parameters
            _check_ckpt_path((self.config.get(sub) or {}).get("ckpt_path"))

    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand)) if self.subcommand else self.config
        if config is not None:
            _check_strategy_name((config.get("trainer") or {}).get("strategy"))
            _follow_root(config)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        return super().instantiate_trainer(**{**kwargs, **perf_precision_for(trainer_config)})

    def before_fit(self) -> None:
        _resolve_ckpt_path(self)

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = []
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            lines.append(f"checkpoints: {ckpt.dirpath}")
        for logger in trainer.loggers:
            if getattr(logger, "log_dir", None):
                lines.append(f"{type(logger).__name__}: {logger.log_dir}")
        for cb in trainer.callbacks:
            for f in getattr(cb, "files", None) or []:
                lines.append(f"{type(cb).__name__}: {f}")
        if lines:
            print("lightning-perf: wrote\n  " + "\n  ".join(lines))


def _first_process() -> bool:
    """Whether this is the job's first process (rank 0), from what launchers set."""
    import os

    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var] == "0"
    node = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    return os.environ.get("LOCAL_RANK", "0") == "0" and node == "0"


def _resolve_ckpt_path(cli: "PerfCLI") -> None:
    """``--ckpt_path last`` as the pack resolves it (:func:`lightning_perf.runtime.resume.resume_path`), for
    the strategies that are not the pack's (theirs does it in its launcher): a crash's half-done rename
    repaired, a missing or dangling ``last`` replaced by the newest complete checkpoint, or a refusal."""
    from lightning_perf.runtime.resume import resume_path
    from lightning_perf.strategies import PerfParallelStrategy

    config = cli.config_init[cli.subcommand]
    ckpt_path = config.get("ckpt_path")
    first = _first_process()
    if isinstance(cli.trainer.strategy, PerfParallelStrategy) or (ckpt_path != "last" and not first):
        return
    try:
        config["ckpt_path"] = resume_path(cli.trainer, ckpt_path, repair=first, announce=first)
    except FileNotFoundError as err:
        raise SystemExit(f"lightning-perf fit: {err}") from err


_HELP = """usage: lightning-perf {{fit,validate,test,predict,generate,prepare,consolidate,convert}} [options]

lightning_perf: train, evaluate and sample the pack's GPT.

Subcommands (each with --help):
  fit          train (LightningCLI); with no --config the gpt-tiny-cpu recipe runs
  validate     evaluate on the validation split (LightningCLI)
  test         evaluate on the test split (LightningCLI)
  predict      run predict_step (LightningCLI)
{own}
Recipes shipped with the package (--config NAME, or --config PATH for your own YAML):
  {recipes}
"""


def _print_help() -> None:
    own = "".join(f"  {name:<12} {text}\n" for name, text in _OWN_SUBCOMMANDS.items())
    print(_HELP.format(own=own, recipes=", ".join(recipe_names())))


# ---- a GPU recipe on the CPU; --help with a recipe's values -------------------------------------


def _config_files(argv: list[str]) -> list[str]:
    """The ``--config`` values of a command line, in order."""
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    return files + [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]


def _merged_recipe(files: list[str]) -> dict[str, Any]:
    """The YAML config files layered as LightningCLI layers them (later keys override earlier ones)."""
    import yaml

    def merge(base: dict, top: dict) -> dict:
        out = dict(base)
        for key, value in top.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    merged: dict[str, Any] = {}
    for f in files:
        try:
            data = yaml.safe_load(Path(f).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue  # the parser reports it
        if isinstance(data, dict):
            merged = merge(merged, data)
    return merged


def _given_options(argv: list[str]) -> set[str]:
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


def cpu_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """For ``--trainer.accelerator cpu`` on a recipe written for GPUs: the flags that switch its GPU-only or
    slow-on-a-CPU settings (compile modes, CUDA graphs among them; half precision; loader workers) to what
    runs fast on a CPU, and one description per switch. Settings the command line names stay as given."""
    if _option_value(argv, "trainer.accelerator") != "cpu":
        return [], []
    recipe = _merged_recipe(_config_files(argv))
    trainer, model, data = (recipe.get(k) or {} for k in ("trainer", "model", "data"))
    if str(trainer.get("accelerator", "")).lower() not in ("gpu", "cuda"):
        return [], []
    given = _given_options(argv)
    flags: list[str] = []
    switched: list[str] = []

    def switch(key: str, old: Any, new: str, *aliases: str) -> None:
        if key in given or any(a in given for a in aliases):
            return
        flags.extend([f"--{key}", new])
        switched.append(f"{key} {old} -> {new}")

    precision = trainer.get("precision")
    if precision is not None and str(precision) not in ("32", "32-true", "64", "64-true"):
        switch("trainer.precision", precision, "32-true")
    if model.get("compile") is not None:  # every compile mode (reduce-overhead: CUDA graphs) compiles for minutes
        switch("model.compile", model["compile"], "null")
    strategy = trainer.get("strategy")
    strategy_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    if strategy_args.get("compile") is not None:
        switch("trainer.strategy.init_args.compile", strategy_args["compile"], "null", "trainer.strategy.compile")
    workers = data.get("num_workers")
    if isinstance(workers, int) and workers > 0:
        switch("data.num_workers", workers, "0")
    return flags, switched


def _switch_gpu_recipe_to_cpu(argv: list[str]) -> list[str]:
    if any(a in ("-h", "--help") for a in argv):
        return argv
    flags, switched = cpu_overrides(argv)
    if switched and os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        # stderr: --print_config's YAML on stdout stays YAML
        sys.stderr.write(f"lightning-perf: a GPU recipe on the CPU: {', '.join(switched)} (name one on the command "
                         "line to keep it)\n")
    return argv + flags


def _recipe_defaults_for_help(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """For ``SUBCOMMAND --config ... --help``: the command line without the configs, and parser arguments
    that make them the subcommand's defaults, so the help shows the recipe's values."""
    if not argv or argv[0] not in _LIGHTNING_SUBCOMMANDS or not any(a in ("-h", "--help") for a in argv):
        return argv, {}
    files = _config_files(argv)
    if not files:
        return argv, {}
    rest, i = [argv[0]], 1
    while i < len(argv):
        if argv[i] in ("--config", "-c"):
            i += 2
            continue
        if not argv[i].startswith("--config="):
            rest.append(argv[i])
        i += 1
    return rest, {argv[0]: {"default_config_files": files}}


def _run_lightning_cli(argv: list[str]) -> None:
    argv = _switch_gpu_recipe_to_cpu(argv)
    argv, help_kwargs = _recipe_defaults_for_help(argv)
    # LightningCLI reads sys.argv (it warns when given args beside a command line)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "lightning-perf", *argv]
    try:
        PerfCLI(
            GPTLightningModule,
            TokenDataModule,
            parser_kwargs={
                "description": "lightning_perf: train, validate, test and predict with the GPT", **help_kwargs
            },
            save_config_kwargs={"overwrite": True},
        )
    finally:
        sys.argv = saved


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
    try:
        tok = load_tokenizer(spec)
    except (ImportError, ValueError, FileNotFoundError) as err:
        raise SystemExit(f"lightning-perf generate: {err}") from err
    if module.config.vocab_size < tok.vocab_size:
        raise SystemExit(
            f"this model's vocabulary ({module.config.vocab_size}) is smaller than the tokenizer's "
            f"({tok.vocab_size}, {tok.name}): pass the model's own with --tokenizer"
        )
    ids = tok.encode(args.prompt, bos=True)
    if not ids:
        raise SystemExit("lightning-perf generate: the tokenizer has no begin-of-text token: give a --prompt")
    idx = torch.tensor([list(ids)], dtype=torch.long, device=args.device)
    out = module.generate(
        idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, eos_id=tok.eos_id, seed=args.seed
    )
    print(tok.decode(out[0].tolist()))


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

    try:
        hparams = read_consolidated_hparams(path)
    except ValueError as err:
        raise SystemExit(f"lightning-perf generate: {err}") from err
    if hparams is None:
        raise SystemExit(
            f"{path} is a consolidated state dict without {consolidated_hparams_path(path).name} (the GPT config "
            "that `lightning-perf consolidate` writes beside it): re-run consolidate on the sharded checkpoint"
        )
    return {"state_dict": {f"model.{k}": v for k, v in state.items()}, "hyper_parameters": hparams}


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
    if not _is_torch_file(path):
        raise SystemExit(f"cannot load checkpoint {path}: not a file written by torch.save (or a truncated one)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # truncated file, not a checkpoint, or a pickled object we refuse to run
        raise SystemExit(f"cannot load checkpoint {path}: {err}") from err
    if isinstance(ckpt, dict) and "state_dict" not in ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        ckpt = _with_consolidated_hparams(path, ckpt)
    hparams = ckpt.get("hyper_parameters") or {}
    if "config" not in hparams:
        raise SystemExit(f"{path} holds no GPT config under 'hyper_parameters': not a lightning_perf checkpoint")
    # the CLI adds private keys (e.g. its instantiator) that are no constructor arguments
    # the checkpoint's weights replace any Hugging Face initialisation: that folder is not read again
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_") and k != "init_from_hf"}
    module = GPTLightningModule(**kwargs)
    module.configure_model()
    state = ckpt["state_dict"]
    module.load_state_dict(state, strict=False)
    missing = [k for k in module.state_dict() if k.startswith("model.") and k not in state]
    if missing:
        raise SystemExit(f"{path} lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    return module.to(map_location).eval()


def main(argv: Optional[list[str]] = None) -> None:
    args, debug = _pop_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        _main(args)
    except Exception as err:
        if not debug:
            _exit_on_user_error(err, args)
        raise


def _main(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help"):
        return _print_help()
    if args[0] == "generate":
        return _generate(args[1:])
    if args[0] == "prepare":
        from lightning_perf.data.prepare import main as prepare_main

        return prepare_main(args[1:])
    if args[0] == "convert":
        from lightning_perf.models.gpt.convert import main as convert_main

        return convert_main(args[1:])
    if args[0] == "consolidate":
        from lightning_perf.parallel.checkpointing.checkpoint import main as consolidate_main

        return consolidate_main(args[1:])
    if args[0] not in _LIGHTNING_SUBCOMMANDS and not args[0].startswith("-"):
        subs = [*_LIGHTNING_SUBCOMMANDS, *_OWN_SUBCOMMANDS]
        close = difflib.get_close_matches(args[0], subs, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise SystemExit(f"lightning-perf: unknown subcommand {args[0]!r}.{hint} Choose one of: {', '.join(subs)}")
    _run_lightning_cli(_with_resolved_config(args))


if __name__ == "__main__":
    main()
