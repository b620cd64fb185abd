"""What "on a GPU" means for the tests, in one place, and the ``gpu`` marker's rules.

``ON_GPU``: this machine has a CUDA device. Tests read it from here, never from
``torch.cuda.is_available()`` themselves (``tests/test_gpu_marker.py`` checks that).

``@pytest.mark.gpu`` selects the GPU run (``pytest -m gpu`` on a GPU machine):

- ``@pytest.mark.gpu``: a GPU-only test (it puts tensors or a Trainer on CUDA). On a machine without
  one, :func:`apply_gpu_marker` (called by ``tests/conftest.py`` at collection) skips it, with
  :data:`SKIP_REASON`;
- ``@pytest.mark.gpu(cpu=True)``: a test that also runs on the CPU (a kernel in Triton's interpreter,
  a model in fp32) and whose GPU path (compiled kernels, half precision) the GPU run checks.
"""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()

SKIP_REASON = "GPU-only: needs a CUDA device (the GPU run is `pytest -m gpu` on a GPU machine)"


def gpu_only(item: pytest.Item) -> bool:
    """Whether ``item`` carries the plain ``gpu`` marker (not ``gpu(cpu=True)``)."""
    mark = item.get_closest_marker("gpu")
    return mark is not None and not mark.kwargs.get("cpu", False)


def apply_gpu_marker(items: list[pytest.Item], on_gpu: bool = ON_GPU) -> None:
    """Skip every GPU-only item when ``on_gpu`` is false; refuse a ``gpu`` marker with other arguments."""
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            continue
        if mark.args or set(mark.kwargs) - {"cpu"}:
            raise pytest.UsageError(f"{item.nodeid}: the gpu marker takes only cpu=True, got "
                                    f"args {mark.args} kwargs {mark.kwargs}")
        if gpu_only(item) and not on_gpu:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
