"""Kernel tests: Triton's CPU interpreter when there is no GPU, NaN-poisoned allocations.

``TRITON_INTERPRET`` is read when a kernel is decorated (``triton.jit`` at import of the
kernel module), so it is set here, before any test module of this folder imports the
kernels, and only on machines without CUDA (on a GPU the kernels compile as usual; setting
it there would also turn torch.compile's own Triton kernels into interpreted ones). Other
test folders are unaffected on CPU: torch.compile uses C++ there, and library code falls
back to the PyTorch references where a kernel cannot launch. Kernel modules imported before
this file (by another folder's tests) are re-imported so they pick the interpreter up.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in sorted(n for n in sys.modules if n.startswith("lightning_perf.kernels.")):
        _module = sys.modules[_name]
        if any(type(v).__name__ == "JITFunction" for v in vars(_module).values()):
            importlib.reload(_module)


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
    return "cuda" if torch.cuda.is_available() else "cpu"
