"""Kernel tests: Triton's CPU interpreter when there is no GPU, NaN-poisoned allocations.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with ``triton.jit``: its own
standard library (``tl.sum``, ``tl.sigmoid``, ...) at ``import triton``, our kernels at the import
of their module. So it is set here, only on machines without CUDA (on a GPU the kernels compile
as usual, and setting it would also turn torch.compile's Triton kernels into interpreted ones).
When this folder runs alone, nothing has imported Triton yet. In a whole-suite run something
earlier usually has (``import lightning`` does), so the Triton language modules and any kernel
module already imported are re-imported here, in interpreter mode, each after the modules whose
kernels it imports (it would keep their compiled kernels otherwise). Other folders are unaffected
on CPU: torch.compile generates C++ there, and the library falls back to the PyTorch references
wherever a kernel cannot launch.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch
from _gpu import ON_GPU, new_tuner


def _is_compiled_jit(fn) -> bool:
    return type(fn).__name__ == "JITFunction"


if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules and _is_compiled_jit(getattr(sys.modules["triton.language"], "sum", None)):
        for _name in ("triton.language.standard", "triton.language.random", "triton.language"):
            if _name in sys.modules:
                importlib.reload(sys.modules[_name])
    _compiled = sorted(n for n in sys.modules if n.startswith("lightning_perf.kernels.")
                       and any(_is_compiled_jit(v) for v in vars(sys.modules[n]).values()))
    _reloaded: set = set()

    def _reload(name: str) -> None:
        """Re-import ``name`` after the modules that define the compiled kernels it holds."""
        if name in _reloaded:
            return
        _reloaded.add(name)
        for value in list(vars(sys.modules[name]).values()):
            owner = value.fn.__module__ if _is_compiled_jit(value) else name
            if owner != name and owner in _compiled:
                _reload(owner)
        importlib.reload(sys.modules[name])

    for _name in _compiled:
        _reload(_name)


if not ON_GPU:  # the kernels' modules apply it at import too; a whole-suite run may have imported them first
    from lightning_perf.kernels._utils import interpreter_scalar_index

    interpreter_scalar_index()


@pytest.fixture
def poison(monkeypatch):
    """Make ``torch.empty`` / ``torch.empty_like`` return NaN-filled tensors (int: -7777) while a test runs.

    Kernel outputs are allocated with them, so an element a kernel forgot to write stays NaN and
    fails the comparison (``assert_close`` never treats NaN as equal).
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            if t.is_floating_point():
                t.fill_(math.nan)
            elif t.dtype != torch.bool:
                t.fill_(-7777)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))
    yield


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: {int((~torch.isfinite(actual)).sum())} non-finite elements"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def close():
    """``close(actual, expected, atol, rtol, what)``: every element finite and within tolerance."""
    return _assert_close


@pytest.fixture
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture
def model_dtype() -> tuple[torch.dtype, float]:
    """(dtype, tolerance factor) for whole-model tests: fp32 in the interpreter; on a GPU fp16, which
    every kernel takes there (the attention kernel refuses fp32 on CUDA and would fall back to SDPA),
    with tolerances widened for half precision and a different summation order."""
    return (torch.float16, 1000.0) if ON_GPU else (torch.float32, 1.0)


class _RelaunchingTuner:
    """A tuner that launches every configuration twice before answering, on every call, whatever the device.

    ``KernelTuner.pick`` times each configuration by launching it several times, but only on a GPU and
    only on a key's first call; on CPU it answers at once. Kernels that write into their inputs must
    tune on copies (the pick contract), or a key's first GPU call returns wrong numbers. Under this
    tuner that mistake shows on CPU, on every call.
    """

    def pick(self, kernel, key, configs, launch, device):
        for cfg in configs:
            launch(dict(cfg))
            launch(dict(cfg))
        return dict(configs[0])


@pytest.fixture
def fresh_tuner(request):
    """A kernel tuner of this run's kind with nothing remembered (``_gpu.new_tuner``): what a test installs
    when a choice another test left in the run's tuner must not decide its launches."""
    return new_tuner(request.config.getoption("gpu_slow"))


@pytest.fixture
def relaunching_tuner(monkeypatch):
    from lightning_perf.kernels import autotune

    monkeypatch.setattr(autotune._Default, "tuner", _RelaunchingTuner())


@pytest.fixture
def flex_backward_on_cpu(monkeypatch, device):
    """torch refuses FlexAttention's backward on CPU at its entry check (torch 2.11 - 2.13); the dense
    backward underneath, which the test needs, runs. On a GPU nothing is changed."""
    if device == "cpu":
        from torch.nn.attention import flex_attention as flex_module

        if not hasattr(flex_module, "_validate_device"):
            pytest.fail("torch.nn.attention.flex_attention._validate_device is gone: update this fixture")
        monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
