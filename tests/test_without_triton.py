"""Triton is optional (the ``triton`` extra): the package and the GPT's PyTorch paths work without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning_perf

# run in a fresh interpreter where ``import triton`` fails, as on an install without the extra
_SCRIPT = """
import sys
sys.modules["triton"] = None

import torch

import lightning_perf
import lightning_perf.callbacks, lightning_perf.data, lightning_perf.parallel, lightning_perf.perf
import lightning_perf.plugins, lightning_perf.strategies, lightning_perf.cli
from lightning_perf.models import GPT, GPTConfig, GPTLightningModule

losses = {}
for kernels in ("torch", "triton"):  # "triton" falls back to the PyTorch paths
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", n_layer=2, kernels=kernels))
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(idx, idx)
    loss.backward()
    losses[kernels] = loss.item()
assert losses["torch"] == losses["triton"], losses
GPTLightningModule("tiny").configure_model()
try:
    from lightning_perf.kernels import rms_norm
except ModuleNotFoundError as err:
    assert "lightning-perf[triton]" in str(err), err
else:
    raise AssertionError("rms_norm imported without Triton")
assert sys.modules["triton"] is None
print("ok", losses["torch"])
"""


def test_package_and_gpt_work_without_triton() -> None:
    root = Path(lightning_perf.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("ok"), out.stdout
