"""``PerfCLI``: LightningCLI (fit / validate / test / predict) with the pack's precision rule,
root-following paths, short errors and ``--ckpt_path last`` resolved as the pack's strategies do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_perf.cli.errors import (
    _check_accelerator,
    _check_ckpt_path,
    _check_model_preset,
    _check_strategy_name,
    _ShortErrorParser,
)
from lightning_perf.cli.progress import step_progress_bar
from lightning_perf.cli.quiet import lightning_notices_filtered
from lightning_perf.cli.recipes import _recipe_defaults_for_help, _switch_gpu_recipe_to_cpu
from lightning_perf.data import TokenDataModule
from lightning_perf.models.gpt.module import GPTLightningModule


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


class PerfCLI(LightningCLI):
    """LightningCLI with the pack's precision rule, root-following paths and short errors."""

    #: whether the run needs the recipe's accelerator on this machine (``lightning-perf plan`` does not)
    needs_device = True

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
        if config is not None:  # before the model is built: a GPU recipe's model can take minutes on a CPU
            prog = f"lightning-perf {self.subcommand}" if self.subcommand else "lightning-perf"
            trainer = config.get("trainer") or {}
            _check_strategy_name(trainer.get("strategy"), prog)
            if self.needs_device:
                _check_accelerator(trainer.get("accelerator"), prog)
            _check_model_preset((config.get("model") or {}).get("config"), prog)
            _follow_root(config)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        extra = {**perf_precision_for(trainer_config), **_with_step_progress_bar(trainer_config)}
        return super().instantiate_trainer(**{**kwargs, **extra})

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


def _with_step_progress_bar(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments that add the CLI's progress bar (:mod:`lightning_perf.cli.progress`) to the
    callbacks; empty when the bar is off or the configuration brings its own."""
    from lightning.pytorch.callbacks import ProgressBar

    if trainer_config.get("enable_progress_bar") is False:
        return {}
    callbacks = trainer_config.get("callbacks")
    callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    if any(isinstance(c, ProgressBar) for c in callbacks):
        return {}
    return {"callbacks": [*callbacks, step_progress_bar()]}


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


def _run_lightning_cli(argv: list[str], *, cli_class: type = PerfCLI, switch_to_cpu: bool = True) -> None:
    if switch_to_cpu:
        argv = _switch_gpu_recipe_to_cpu(argv)
    argv, help_kwargs = _recipe_defaults_for_help(argv)
    # LightningCLI reads sys.argv (it warns when given args beside a command line)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "lightning-perf", *argv]
    try:
        with lightning_notices_filtered():
            cli_class(
                GPTLightningModule,
                TokenDataModule,
                parser_kwargs={
                    "description": "lightning_perf: train, validate, test and predict with the GPT", **help_kwargs
                },
                save_config_kwargs={"overwrite": True},
            )
    finally:
        sys.argv = saved
