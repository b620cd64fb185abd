"""Small helpers shared by the kernel files: where a kernel can run, launch sizes (private to ``kernels``;
``kernels.dtensor`` holds the DTensor check the models use too)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "is_interpreted",
    "launch_device",
    "can_launch",
    "next_power_of_2",
    "cdiv",
    "kernel_dtypes",
    "num_sms",
    "ELEMENTWISE_DTYPES",
]

# dtypes the kernels accept: fp32 runs on the GPU and in the interpreter, the half types on the GPU
ELEMENTWISE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted(kernel: Any) -> bool:
    """True when ``kernel`` was built by Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def launch_device(kernel: Any) -> str:
    """The device type ``kernel`` launches on: ``"cpu"`` for an interpreted kernel, else ``"cuda"``.

    Call it where the kernel is defined, at import, and keep the string: under ``torch.compile``
    Dynamo wraps a compiled Triton kernel in a variable whose Python type it cannot take, so asking
    the kernel object inside a traced function (``type(kernel)``) fails on the GPU.
    """
    if is_interpreted(kernel):
        interpreter_scalar_index()
        return "cpu"
    return "cuda"


def interpreter_scalar_index() -> None:
    """Let Triton's CPU interpreter use a scalar argument as a Python int (``range(0, V, BLOCK)``).

    Triton 3.6's interpreter holds scalars in one-element 1-D NumPy arrays and converts them with
    ``int(array)``, which NumPy 2.4 refuses; Triton 3.9 squeezes the array first. On older
    interpreters this does the same (once, idempotent). Kernels compiled for a GPU are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no Triton: nothing is interpreted
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def can_launch(device_type: str, *tensors: torch.Tensor) -> bool:
    """Whether a kernel whose :func:`launch_device` is ``device_type`` can run on the tensors.

    A compiled kernel needs CUDA tensors; an interpreted one (built while ``TRITON_INTERPRET=1``
    was set) needs CPU tensors. Mixed devices never launch.
    """
    devices = {t.device.type for t in tensors if t is not None}
    return len(devices) == 1 and devices == {device_type}


def kernel_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """dtypes the kernels take on ``device``: bf16 is silently wrong in the CPU interpreter."""
    if device.type == "cuda":
        return ELEMENTWISE_DTYPES
    return (torch.float32, torch.float16)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids; plain integer maths (``triton.cdiv`` is a constexpr
    function object in recent Triton releases, several microseconds per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small fixed number elsewhere (interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4
