"""The ``lightning-perf`` command: LightningCLI (fit / validate / test / predict) plus generate, prepare, consolidate.

    lightning-perf fit                                   # the gpt-tiny-cpu recipe (tiny GPT, built-in corpus, CPU)
    lightning-perf fit --config gpt2-124m                # a recipe shipped with the package, by name
    lightning-perf fit --config my_recipe.yaml           # or a file; flags override either
    lightning-perf generate --ckpt_path last.ckpt --prompt "def main("
    lightning-perf prepare --input my_texts/ --out_dir data/mine
    lightning-perf consolidate --ckpt_dir ckpts/step=100 --out model.pt
    lightning-perf convert --from_hf hf/Llama-3.2-1B --out llama.ckpt    # or --to_hf last.ckpt --out hf/mine
    lightning-perf plan --config llama-8b-zero3 --gpu-memory-gb 85       # peak GPU memory and the 'auto' choice

What the CLI adds to Lightning's:

- ``--config NAME`` finds the recipes in ``lightning_perf/configs/``; with no ``--config`` the
  default recipe applies, and only then.
- ``trainer.precision`` becomes a :class:`~lightning_perf.plugins.PerfPrecision` on the
  single-device and DDP strategies as it already does on the pack's, so gradient clipping works
  with the fused AdamW (Lightning's mixed-precision plugin refuses that combination).
- Paths a recipe puts under its ``trainer.default_root_dir`` (logger ``save_dir``, checkpoint
  ``dirpath``) follow ``--trainer.default_root_dir`` when it is overridden.
- A mistyped option, strategy name or ``--model.config`` preset gets a short error with the closest
  valid names instead of the usage text; a GPU recipe on a machine without a GPU, two lines naming
  ``--trainer.accelerator cpu`` and the CPU recipe.
- A step-bounded run's progress bar counts steps of ``max_steps``; Lightning's notices a user cannot act
  on are left out (``quiet``).
- GPU memory: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless set (less fragmentation: the memory
  planner's headroom assumes it).
- A CUDA out-of-memory error ends in three lines naming the settings to change and ``lightning-perf plan``;
  the traceback goes to ``oom_rank<R>.log`` under the run's ``default_root_dir``.
- Bad input found while a run sets up (a missing file, a layout or checkpoint that does not fit, a
  ``ValueError`` of the pack) is printed in a few lines naming the file or option and the fix, exit
  status 1; ``LIGHTNING_PERF_DEBUG=1`` or ``--debug`` keeps the traceback.
- ``--trainer.accelerator cpu`` on a GPU recipe switches its compile modes, half precision and loader
  workers to CPU settings (one printed line); ``--config NAME --help`` shows the recipe's values.
- ``--ckpt_path last`` never starts over silently: see :func:`lightning_perf.runtime.resume.resume_path`.

The modules: ``recipes`` (``--config`` names, the default recipe, a GPU recipe on the CPU),
``perf_cli`` (:class:`PerfCLI`, the Lightning subcommands), ``errors`` (short errors), ``progress``
(the step-counting progress bar), ``quiet`` (Lightning's notices left out), ``generate``
(``lightning-perf generate``, :func:`load_module`), ``plan`` (``lightning-perf plan``), ``oom`` (out-of-memory
errors), ``caches`` (where compiled kernels and tuning results persist between runs) and ``shutdown`` (how the
command's process ends).
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Optional

import torch

import lightning_perf  # noqa: F401  (registers the strategy names)
from lightning_perf.cli.caches import cache_dirs, use_cache_dirs
from lightning_perf.cli.errors import DEBUG_ENV, _exit_on_user_error, _pop_debug, user_error_message
from lightning_perf.cli.generate import _generate, load_module
from lightning_perf.cli.oom import is_out_of_memory, report_out_of_memory
from lightning_perf.cli.perf_cli import PerfCLI, _run_lightning_cli, perf_precision_for
from lightning_perf.cli.recipes import (
    _LIGHTNING_SUBCOMMANDS,
    DEFAULT_RECIPE,
    _with_resolved_config,
    cpu_overrides,
    default_config_path,
    recipe_dir,
    recipe_names,
    resolve_recipe,
)
from lightning_perf.cli.shutdown import end_process

__all__ = [
    "main",
    "recipe_dir",
    "recipe_names",
    "resolve_recipe",
    "default_config_path",
    "load_module",
    "cpu_overrides",
    "perf_precision_for",
    "user_error_message",
    "DEBUG_ENV",
    "DEFAULT_RECIPE",
    "PerfCLI",
]

_OWN_SUBCOMMANDS = {
    "generate": "sample text from a checkpoint (--ckpt_path, --prompt)",
    "prepare": "tokenize text files into train.bin / val.bin for source: memmap (--input, --out_dir)",
    "consolidate": "turn a sharded checkpoint directory into one model.pt (--ckpt_dir, --out)",
    "convert": "Hugging Face folder <-> checkpoint (--from_hf DIR or --to_hf CKPT, --out)",
    "plan": "peak GPU memory of fit's arguments, by part, and the 'auto' settings (--gpu-memory-gb, --json)",
}


_HELP = """usage: lightning-perf {{fit,validate,test,predict,generate,prepare,consolidate,convert,plan}} [options]

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


def main(argv: Optional[list[str]] = None, *, command: Optional[bool] = None) -> None:
    """The ``lightning-perf`` command on ``argv`` (default: the command line).

    ``command``: run as the command, whose process ends with it (default: when ``argv`` is None):
    compiled kernels and tuning results go to their persistent folders (:mod:`lightning_perf.cli.caches`),
    and a Lightning subcommand that completes ends the process without the interpreter's teardown
    (:func:`lightning_perf.cli.shutdown.end_process`). A caller that goes on running (a test, a notebook)
    keeps its environment and its process.
    """
    command = argv is None if command is None else command
    args, debug = _pop_debug(list(sys.argv[1:] if argv is None else argv))
    if command:
        use_cache_dirs(cache_dirs(os.environ), environ=os.environ)
        # CUDA's caching allocator grows segments instead of splitting them (the memory planner's headroom
        # assumes it); read at the first CUDA allocation, inherited by the ranks Lightning starts. A value the
        # user set stays.
        if torch.cuda.is_available():  # (does not start CUDA)
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        _main(args)
    except Exception as err:
        if not debug:
            if is_out_of_memory(err):
                raise SystemExit(report_out_of_memory(err, args, args[0] if args else "fit")) from None
            _exit_on_user_error(err, args)
        raise
    if command and args and args[0] in _LIGHTNING_SUBCOMMANDS:
        end_process(0)


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
    if args[0] == "plan":
        from lightning_perf.cli.plan import plan_main

        return plan_main(args[1:])
    if args[0] == "consolidate":
        from lightning_perf.parallel.checkpointing.checkpoint import main as consolidate_main

        return consolidate_main(args[1:])
    if args[0] not in _LIGHTNING_SUBCOMMANDS and not args[0].startswith("-"):
        subs = [*_LIGHTNING_SUBCOMMANDS, *_OWN_SUBCOMMANDS]
        close = difflib.get_close_matches(args[0], subs, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise SystemExit(f"lightning-perf: unknown subcommand {args[0]!r}.{hint} Choose one of: {', '.join(subs)}")
    _run_lightning_cli(_with_resolved_config(args))
