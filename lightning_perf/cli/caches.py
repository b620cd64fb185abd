"""Where compiled kernels and tuning results persist between runs, as the ``lightning-perf`` command sets it.

A compiled recipe's first step compiles the model (Dynamo, AOTAutograd, Inductor), builds its Triton
kernels and tunes their launch configurations; a restarted run finds all of that on disk when the
caches live somewhere that survives the process, the job and the node's ``/tmp``:

- Inductor's caches (the FX graph cache, the AOTAutograd cache, the autotuning results of the Triton
  kernels it launches): ``TORCHINDUCTOR_CACHE_DIR``, by default ``<root>/inductor``;
- Triton's compiled kernels: ``TRITON_CACHE_DIR``, by default ``<root>/triton``;
- the pack's tuned launch configurations (``kernels.autotune``): ``<root>/autotune``; and the
  ``attention="auto"`` choices (``kernels.dispatch.AttentionSelector``): ``<root>/attention``.

``root`` is ``LIGHTNING_PERF_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_perf``, else
``~/.cache/lightning_perf``; a variable already set is kept (``TORCHINDUCTOR_CACHE_DIR`` unless it
holds torch's own default, ``/tmp/torchinductor_<user>``, which importing ``torch._dynamo`` writes
into the environment). Every entry is keyed by what it depends on (graph, inputs, configuration,
compiler and library versions, GPU name), so sharing the folders between runs, jobs and nodes is
safe; deleting them costs one cold start. See docs/performance.md.

AOTAutograd skips its cache for a graph that holds an autograd ``Function`` or an autocast region
(torch keeps both behind switches while it widens its own tests): the FP8 linears are both, so by
default every restart of an FP8 recipe traced and partitioned its joint graph again. Both switches
are turned on here (:func:`allow_aot_autograd_cache`): Dynamo traces the Function's forward and
backward into the graph the cache key is computed from, and an autocast region's arguments are
constants in it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CacheDirs", "cache_dirs", "use_cache_dirs", "allow_aot_autograd_cache", "ROOT_ENV"]

ROOT_ENV = "LIGHTNING_PERF_CACHE_DIR"
_AUTOCAST_REGION = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


@dataclass(frozen=True, kw_only=True)
class CacheDirs:
    """The folders of :mod:`lightning_perf.cli.caches`' module docstring."""

    root: Path
    inductor: Path
    triton: Path
    autotune: Path
    attention: Path


def cache_dirs(environ: Mapping[str, str]) -> CacheDirs:
    """The cache folders ``environ`` asks for (see the module docstring); nothing is created."""
    if environ.get(ROOT_ENV):
        root = Path(environ[ROOT_ENV])
    elif environ.get("XDG_CACHE_HOME"):
        root = Path(environ["XDG_CACHE_HOME"]) / "lightning_perf"
    else:
        root = Path(environ.get("HOME") or Path.home()) / ".cache" / "lightning_perf"
    root = root.expanduser().absolute()
    inductor = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor and Path(inductor) == Path(_torch_default_inductor_dir()):
        inductor = None  # written by torch at import (torch._dynamo), not asked for
    return CacheDirs(
        root=root,
        inductor=Path(inductor or root / "inductor").expanduser().absolute(),
        triton=Path(environ.get("TRITON_CACHE_DIR") or root / "triton").expanduser().absolute(),
        autotune=root / "autotune",
        attention=root / "attention",
    )


def _torch_default_inductor_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def use_cache_dirs(dirs: CacheDirs, *, environ: MutableMapping[str, str]) -> None:
    """Point this process (and the processes it starts: compile workers, the ranks a launcher starts)
    at ``dirs``: Inductor's and Triton's through ``environ`` (both read it when they first write), the
    pack's tuner and attention selector directly; and let AOTAutograd cache the pack's graphs
    (:func:`allow_aot_autograd_cache`)."""
    from lightning_perf.kernels import autotune, dispatch

    environ["TORCHINDUCTOR_CACHE_DIR"] = str(dirs.inductor)
    environ["TRITON_CACHE_DIR"] = str(dirs.triton)
    autotune.configure(cache_dir=dirs.autotune)
    current = dispatch.default_dispatcher()
    dispatch.set_default_dispatcher(dispatch.KernelDispatcher(
        attention_selector=dispatch.AttentionSelector(cache=autotune.AutotuneCache(directory=dirs.attention)),
        elementwise_under_compile=current.elementwise_under_compile))
    allow_aot_autograd_cache()


def allow_aot_autograd_cache() -> None:
    """Let AOTAutograd's cache hold graphs with autograd ``Function``\\ s and autocast regions (see the module
    docstring). Where this torch lacks either switch, its graphs are left uncached as before."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        # the value is part of the cache key: a new torch version starts new entries
        inductor_config.unsafe_marked_cacheable_functions = {**marked, **{f: torch.__version__
                                                                           for f in _AUTOCAST_REGION}}
