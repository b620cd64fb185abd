"""What "on a GPU" means for the tests, in one place: the ``gpu`` and ``gpu_slow`` markers' rules, the GPU
run's launch configurations and its split over the GPUs of one host.

``ON_GPU``: this machine has a CUDA device. Tests read it from here, never from
``torch.cuda.is_available()`` themselves (``tests/test_gpu_marker.py`` checks that).

``@pytest.mark.gpu`` selects the GPU run (``pytest -m gpu`` on a GPU machine):

- ``@pytest.mark.gpu``: a GPU-only test (it puts tensors or a Trainer on CUDA). On a machine without
  one, :func:`apply_gpu_marker` (called by ``tests/conftest.py`` at collection) skips it, with
  :data:`SKIP_REASON`;
- ``@pytest.mark.gpu(cpu=True)``: a test that also runs on the CPU (a kernel in Triton's interpreter,
  a model in fp32) and whose GPU path (compiled kernels, half precision) the GPU run checks;
- ``@pytest.mark.gpu(gpus=N)``: a GPU-only test that needs N devices; skipped, with the count it saw,
  where fewer are visible (one GPU, or one shard of :func:`shard`).

Kernel tests that take the ``device`` fixture (``tests/kernels/conftest.py``) run on CUDA too where there is
one, but only those marked ``gpu(cpu=True)`` are in the GPU run; the others check the same kernel code in the
interpreter.

``@pytest.mark.gpu_slow`` (on a test or on one ``pytest.param``, beside a ``gpu`` marker): a case the
GPU run leaves out unless ``--gpu-slow`` is given, because a faster case proves the same point (more
shapes, both half-precision dtypes, every autotuning candidate). It changes nothing on a machine
without CUDA: there the case runs or is skipped as its ``gpu`` marker says.

Launch configurations: on a GPU each kernel's tuner times every candidate configuration on a shape's
first call, and every candidate is a kernel of its own to compile (seconds each); a test with a new
head dim, dtype or mask compiles dozens. The GPU run launches each kernel with its first candidate that
launches instead (:class:`FirstConfigTuner`; Triton-autotuned kernels keep their first config), which
is one compile per kernel variant; ``--gpu-slow`` restores the timing tuner, without its disk cache, so
every candidate is compiled and run as in a fresh training run.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import pytest
import torch

ON_GPU = torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if ON_GPU else 0

SKIP_REASON = "GPU-only: needs a CUDA device (the GPU run is `pytest -m gpu` on a GPU machine)"
SLOW_REASON = "gpu_slow: a faster case checks the same on a GPU; run it with `pytest -m gpu --gpu-slow`"


def gpu_only(item: pytest.Item) -> bool:
    """Whether ``item`` carries the plain ``gpu`` marker (not ``gpu(cpu=True)``)."""
    mark = item.get_closest_marker("gpu")
    return mark is not None and not mark.kwargs.get("cpu", False)


def _gpus_needed(item: pytest.Item) -> int:
    mark = item.get_closest_marker("gpu")
    if mark.args or set(mark.kwargs) - {"cpu", "gpus"}:
        raise pytest.UsageError(f"{item.nodeid}: the gpu marker takes only cpu=True or gpus=N, got "
                                f"args {mark.args} kwargs {mark.kwargs}")
    gpus = mark.kwargs.get("gpus", 1)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise pytest.UsageError(f"{item.nodeid}: gpu(gpus=...) takes a device count >= 1, got {gpus!r}")
    if gpus > 1 and mark.kwargs.get("cpu", False):
        raise pytest.UsageError(f"{item.nodeid}: gpu(gpus={gpus}) needs GPUs; it cannot also run on the CPU "
                                f"(drop cpu=True)")
    return gpus


def apply_gpu_marker(items: list[pytest.Item], on_gpu: bool = ON_GPU, *, run_slow: bool = False,
                     gpu_count: int = GPU_COUNT) -> None:
    """Skip what this machine cannot or should not run: GPU-only items without CUDA, items needing more
    GPUs than ``gpu_count``, ``gpu_slow`` items on a GPU unless ``run_slow``. Refuse a ``gpu`` marker with
    other arguments and a ``gpu_slow`` marker without a ``gpu`` one."""
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            if item.get_closest_marker("gpu_slow") is not None:
                raise pytest.UsageError(f"{item.nodeid}: gpu_slow marks a case of the GPU run; add @pytest.mark.gpu "
                                        f"(or gpu(cpu=True)) to the test")
            continue
        gpus = _gpus_needed(item)
        if gpu_only(item) and not on_gpu:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
        elif on_gpu and gpus > 1 and gpus > gpu_count:
            item.add_marker(pytest.mark.skip(reason=f"needs {gpus} GPUs, {gpu_count} visible (run it with "
                                                    f"`pytest -m gpu` where CUDA_VISIBLE_DEVICES shows {gpus})"))
        elif on_gpu and not run_slow and item.get_closest_marker("gpu_slow") is not None:
            item.add_marker(pytest.mark.skip(reason=SLOW_REASON))


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--gpu-shard takes I/N (shard I of N, counted from 0), got {text!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"--gpu-shard {text}: I must be in 0..N-1 (shard I of N), got I={index} N={count}")
    return index, count


def shard(items: Sequence[pytest.Item], index: int, count: int) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """(kept, deselected): the items of shard ``index`` of ``count``, in collection order.

    The cases that will run are dealt round-robin in collection order, and so are the skipped ones:
    a test function's costly cases (each compiling kernels of its own) spread over the shards, and every
    process computes the same split from the same collection.
    """
    running = [item for item in items if item.get_closest_marker("skip") is None]
    skipped = [item for item in items if item.get_closest_marker("skip") is not None]
    mine = {id(item) for item in running[index::count] + skipped[index::count]}
    kept = [item for item in items if id(item) in mine]
    return kept, [item for item in items if id(item) not in mine]


def add_gpu_options(parser: pytest.Parser) -> None:
    """``--gpu-slow`` and ``--gpu-shard`` (``tests/conftest.py`` registers them)."""
    group = parser.getgroup("gpu", "the GPU run (pytest -m gpu; tests/_gpu.py)")
    group.addoption("--gpu-slow", action="store_true", default=False,
                    help="on a GPU, also run the cases marked gpu_slow, and let every kernel time all of its "
                         "launch configurations (as a fresh training run does) instead of taking the first")
    group.addoption("--gpu-shard", metavar="I/N", default=None,
                    help="run shard I (from 0) of N of the selected tests, dealt round-robin "
                         "(tests/gpu_split.sh runs one per GPU)")


def select_gpu_items(config: pytest.Config, items: list[pytest.Item], on_gpu: bool = ON_GPU,
                     gpu_count: int = GPU_COUNT) -> None:
    """The collection hook's work, after ``-m`` / ``-k``: :func:`apply_gpu_marker`, then ``--gpu-shard``."""
    apply_gpu_marker(items, on_gpu, run_slow=config.getoption("gpu_slow"), gpu_count=gpu_count)
    if config.getoption("gpu_shard"):
        kept, deselected = shard(items, *parse_shard(config.getoption("gpu_shard")))
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept


class FirstConfigTuner:
    """The GPU run's kernel tuner: a key's first call launches its candidates (when there are several) in
    order and keeps the first that launches (a candidate can fail to compile, e.g. out of shared memory);
    nothing is timed, nothing is read from or written to disk. Like the timing tuner it then launches the
    kernel again for the call itself, so a kernel whose launches do not repeat still shows (the pick
    contract)."""

    def __init__(self) -> None:
        self.picked: dict[tuple, dict[str, Any]] = {}

    def pick(self, kernel: str, key: Sequence[Any], configs: Sequence[dict], launch: Callable[[dict], Any],
             device: torch.device) -> dict[str, Any]:
        if not configs:
            raise ValueError(f"no launch configuration given for kernel {kernel!r}")
        memo = (kernel, tuple(key), str(device))
        if memo in self.picked:
            return self.picked[memo]
        if len(configs) == 1:
            return dict(configs[0])
        errors = []
        for cfg in configs:
            try:
                launch(dict(cfg))
            except Exception as err:  # as KernelTuner: a config this GPU cannot run is skipped
                errors.append(f"{cfg}: {type(err).__name__}: {err}")
                continue
            self.picked[memo] = dict(cfg)
            return self.picked[memo]
        raise RuntimeError(f"every launch configuration of {kernel} failed for key {key}:\n" + "\n".join(errors))


def new_tuner(slow: bool):
    """A kernel tuner of this run's kind with nothing remembered: :class:`FirstConfigTuner` in the GPU run,
    the timing tuner without its disk cache with ``--gpu-slow`` (``slow``) and off the GPU (where it times
    nothing and takes the first candidate)."""
    if ON_GPU and not slow:
        return FirstConfigTuner()
    from lightning_perf.kernels.autotune import AutotuneCache, KernelTuner

    return KernelTuner(AutotuneCache(enabled=False))


_SESSION_TUNER: list = []  # --gpu-slow: one timing tuner for the session, as one for a training process


def use_gpu_run_tuning(monkeypatch: pytest.MonkeyPatch, slow: bool) -> None:
    """For one test on a GPU: the kernels' default tuner is this run's (a fresh :class:`FirstConfigTuner`,
    or with ``slow`` the session's timing tuner), and without ``slow`` every Triton-autotuned kernel of the
    library keeps only its first config (Inductor's generated code reads the same list)."""
    from lightning_perf.kernels import autotune  # here, not at import: on CPU the kernels' conftest imports first

    if slow:
        if not _SESSION_TUNER:
            _SESSION_TUNER.append(new_tuner(slow=True))
        monkeypatch.setattr(autotune._Default, "tuner", _SESSION_TUNER[0])
        return
    monkeypatch.setattr(autotune._Default, "tuner", FirstConfigTuner())
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no Triton: the library runs its PyTorch references
        return
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_perf.") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    monkeypatch.setattr(value, "configs", value.configs[:1])
