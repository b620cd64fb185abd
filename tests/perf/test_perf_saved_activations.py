"""Bytes saved for backward, counted against a hand count of what each op of a small block model saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_perf.perf.saved_activations import SavedTensorCounter, producer_of

B, T, D_IN, D, V, L = 2, 3, 4, 8, 5, 2  # batch, sequence, input width, model width, outputs, blocks


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): norm saves x, mean and rstd; fc1 saves norm(x); gelu saves fc1's output;
    fc2 saves gelu's output; the residual add saves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)  # saves the raw input (outside the blocks)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.head = nn.Linear(D, V)  # saves the last block's output (outside the blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_saved_bytes_match_the_hand_count():
    torch.manual_seed(0)
    net = Net()
    counter = SavedTensorCounter(net.blocks)
    with counter:
        loss = net(torch.randn(B, T, D_IN)).sum()
    loss.backward()  # the hooks are gone: backward runs as usual
    r = counter.result
    f32, bt = 4, B * T
    per_block = {"x": D, "mean": 1, "rstd": 1, "norm(x)": D, "fc1 out": 4 * D, "gelu out": 4 * D}
    in_blocks = L * sum(per_block.values()) * bt * f32
    assert r.in_blocks == in_blocks
    assert r.total == in_blocks + (D_IN + D) * bt * f32  # + embed's input and head's input; no weight counted
    assert r.block_inputs == L * D * bt * f32
    # selective keeps matmul outputs (fc1 out) and the block input; recomputes norm(x) and gelu out;
    # mean / rstd come out of the norm with no autograd history
    assert r.recomputed_by_selective == L * (D + 4 * D) * bt * f32
    assert r.unclassified_in_blocks == L * 2 * bt * f32
    assert r.blocks == L
    assert r.selective_saves == int(r.recomputed_by_selective * (1 - 1 / L))  # one block recomputed at a time
    assert r.full_saves == int(in_blocks - r.block_inputs - in_blocks / L)
    assert all(p.grad is not None for p in net.parameters())


def test_producers_are_found_through_views():
    w = torch.randn(4, 6, requires_grad=True)
    y = (torch.randn(3, 4) @ w).view(2, 9).transpose(0, 1)[1:]
    assert producer_of(y) == "MmBackward0"
    assert producer_of(F.gelu(y)) == "GeluBackward0"
    assert producer_of(torch.randn(3)) is None


def test_nothing_is_counted_once_removed():
    net = Net()
    counter = SavedTensorCounter(net.blocks)
    counter.install()
    counter.install()  # idempotent
    counter.remove()
    net(torch.randn(B, T, D_IN)).sum().backward()
    assert counter.result.total == 0
    assert counter.result.selective_saves == 0 and counter.result.full_saves == 0
    assert SavedTensorCounter().result.selective_saves is None  # no blocks: nothing to checkpoint


@pytest.mark.parametrize("dtype,size", [(torch.bfloat16, 2), (torch.float16, 2)])
def test_half_precision_activations_are_half_the_bytes(dtype, size):
    x = torch.randn(5, 7, dtype=dtype, requires_grad=True)
    counter = SavedTensorCounter()
    with counter:
        y = torch.sigmoid(x * 2.0)  # mul saves no activation (scalar); sigmoid saves its output
    y.sum().backward()
    assert counter.result.total == 5 * 7 * size
