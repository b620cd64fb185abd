"""Recipes: ``--config NAME`` resolved to the shipped YAML, the default recipe, and a GPU recipe on the CPU.

``--config`` takes a file or the name of a recipe in ``lightning_perf/configs/``; a Lightning
subcommand without one runs the default recipe. ``--trainer.accelerator cpu`` on a recipe written for
GPUs switches its GPU-only or slow-on-a-CPU settings (:func:`cpu_overrides`), and
``SUBCOMMAND --config ... --help`` shows the recipe's values as the defaults.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any, Optional

DEFAULT_RECIPE = "gpt-tiny-cpu"
_LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


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


def _option_value(args: list[str], name: str) -> Optional[str]:
    """The value of ``--name V`` / ``--name=V`` on a command line (the last one), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


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
