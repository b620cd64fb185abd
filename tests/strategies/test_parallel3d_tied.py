"""A tied LM head under pipeline parallelism: the first and the last stage each hold a copy of the token
embedding, kept equal by summing their gradients over the embedding group.

The tiny GPT-2-style model of ``test_parallel3d`` (learned positions, tied head) trains inside the Trainer
on CPU processes (gloo) and must give one process's losses (rtol 1e-4) and final parameters, with the two
copies bit for bit equal after every run:

- 2 ranks: pp2 1F1B saved after one epoch and resumed, gradient accumulation, gradient-norm clipping (the tied weight counted
  once, by hand count), the V-shaped schedule (first and last stage on one rank: one parameter), fp16 loss scaling,
  meta-device init (the last stage's copy broadcast from the first's), and checkpoints to and from one
  process;
- 4 ranks: pp2 x dp2 with ZeRO-2 (copies sharded over dp, summed shard by shard) and pp2 x tp2
  (vocabulary-parallel copies, summed shard by shard).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _spawn import spawn
from test_parallel3d import PER_EPOCH, S, fit, make_module, tiny_config

from lightning_perf.parallel.model_parallel.pipeline import zbv_runs_on_gloo

TIED = "model.tok_emb.weight"
# torch runs the V-shaped zero-bubble schedule on gloo from 2.13 on (before, the strategy refuses it there:
# test_zbv_on_gloo_is_refused_before_any_process_group)
ZBV_ON_GLOO = zbv_runs_on_gloo()


def _worker2(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.models.gpt import GPT
    from lightning_perf.parallel.checkpointing.checkpoint import consolidate, load_checkpoint
    from lightning_perf.plugins.precision import PerfPrecision

    res: dict[str, Any] = {}
    ckpt = out / "pp2.ckpt"
    res["pp2"] = fit(S(pipeline_parallel_size=2), world, kind="gpt2", steps=PER_EPOCH, save_to=ckpt)
    res["pp2_resumed"] = fit(S(pipeline_parallel_size=2), world, kind="gpt2", ckpt_path=ckpt)
    # the sum over the embedding group adds each micro-step's gradients once to what accumulated before
    res["pp2_accumulate2"] = fit(S(pipeline_parallel_size=2), world, kind="gpt2", accumulate=2)
    # stages 0 and 3 on rank 0 (one parameter, no group), stages 1 and 2 on rank 1
    zbv = S(pipeline_parallel_size=2, pipeline_schedule="zbv_zero_bubble", stages_per_rank=2, num_microbatches=4)
    if ZBV_ON_GLOO:
        res["pp2_zbv"] = fit(zbv, world, kind="gpt2_l4")
    res["pp2_fp16"] = fit(S(pipeline_parallel_size=2), world, kind="gpt2", plugins=[PerfPrecision("16-mixed")])
    # each rank draws its own values on meta init: the copies must still start (and end) equal
    meta = S(pipeline_parallel_size=2, meta_init=True)
    res["pp2_meta"] = fit(meta, world, kind="gpt2", steps=PER_EPOCH)
    # a one-process checkpoint (written by the test) fills both copies
    load_checkpoint(out / "one.ckpt", meta.lightning_module)
    res["from_one"] = {k: v.detach().clone() for k, v in meta.lightning_module.state_dict().items()}
    # clipping by the global norm counts the tied weight once: every gradient 1 over the whole model
    # (N elements) has norm sqrt(N); clipping to sqrt(N) / 2 makes every gradient 0.5
    params = list(meta.lightning_module.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    numel = sum(p.numel() for p in GPT(tiny_config("gpt2")).parameters())
    meta._clip_grad_by_norm(SimpleNamespace(param_groups=[{"params": params}]), numel**0.5 / 2)
    res["clipped"] = sorted({round(float(v), 6) for p in params for v in p.grad.unique()})
    if rank == 0:
        consolidate(ckpt, out / "consolidated.pt")
    return res


def _worker4(rank: int, world: int, out: Path) -> dict:
    return {
        "pp2_dp2_zero2": fit(S(pipeline_parallel_size=2, zero_stage=2), world, dp=2, kind="gpt2"),
        "pp2_tp2": fit(S(pipeline_parallel_size=2, tensor_parallel_size=2), world, kind="gpt2"),
    }


def _check(results: list[dict], key: str, ref: dict, *, first: int = 0, rtol: float = 1e-4,
           atol: float = 5e-5) -> None:
    losses = torch.tensor([r[key]["losses"] for r in results]).mean(0)
    expected = torch.tensor(ref["losses"][first:first + len(losses)])
    torch.testing.assert_close(losses, expected, rtol=rtol, atol=0, msg=lambda m: f"{key} losses: {m}")
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r[key]["final"])
    assert set(merged) == set(ref["final"]), f"{key}: {set(merged) ^ set(ref['final'])}"
    if rtol <= 1e-4:
        for name, value in ref["final"].items():
            torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=atol, msg=lambda m: f"{key} {name}: {m}")


def _copies(results: list[dict], key: str, pairs: list[tuple[int, int]]) -> None:
    """The first stage's and the last stage's copy, bit for bit, on every embedding group."""
    for a, b in pairs:
        assert TIED in results[a][key]["final"] and TIED in results[b][key]["final"], key
        assert torch.equal(results[a][key]["final"][TIED], results[b][key]["final"][TIED]), (key, a, b)


@pytest.fixture(scope="module")
def references():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    def one(kind: str = "gpt2", **kwargs: Any) -> dict:
        return fit(SingleDeviceStrategy(torch.device("cpu")), 1, kind=kind, **kwargs)

    return {"gpt2": one(), "epoch": one(steps=PER_EPOCH), "l4": one("gpt2_l4"), "accumulate2": one(accumulate=2)}


def _module(state: dict[str, torch.Tensor]):
    module = make_module("gpt2")
    module.configure_model()
    module.load_state_dict(state)
    return module


@pytest.mark.slow
def test_tied_head_two_ranks(references, tmp_path) -> None:
    from lightning_perf.models.gpt import GPT
    from lightning_perf.parallel.checkpointing.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path / "one.ckpt", _module(references["epoch"]["final"]))
    results = spawn(_worker2, 2, tmp_path, timeout=300.0)
    ref = references["gpt2"]
    _check(results, "pp2", references["epoch"])
    _check(results, "pp2_resumed", ref, first=PER_EPOCH)
    if ZBV_ON_GLOO:
        _check(results, "pp2_zbv", references["l4"])
    # one weight element of 4096 with a near-zero gradient differs by ~1.6e-4: Adam scales rounding noise up
    _check(results, "pp2_accumulate2", references["accumulate2"], atol=3e-4)
    assert [r["clipped"] for r in results] == [[0.5], [0.5]]
    _check(results, "pp2_fp16", ref, rtol=2e-2)
    for key in ("pp2", "pp2_resumed", "pp2_accumulate2", "pp2_fp16", "pp2_meta"):
        _copies(results, key, [(0, 1)])
    if ZBV_ON_GLOO:
        assert TIED in results[0]["pp2_zbv"]["final"] and TIED not in results[1]["pp2_zbv"]["final"]
    # one process -> pp2: both ranks hold the reference's values
    for r in results:
        torch.testing.assert_close(r["from_one"][TIED], references["epoch"]["final"][TIED], rtol=0, atol=0)
    # pp2 -> one process: the DCP checkpoint, and its consolidation, hold the tied weight once
    module = _module({k: torch.zeros_like(v) for k, v in references["epoch"]["final"].items()})
    load_checkpoint(tmp_path / "pp2.ckpt", module)
    for name, value in references["epoch"]["final"].items():
        torch.testing.assert_close(module.state_dict()[name], value, rtol=1e-4, atol=5e-5)
    state = torch.load(tmp_path / "consolidated.pt", weights_only=True)
    assert "tok_emb.weight" in state and "lm_head.weight" not in state
    GPT(make_module("gpt2").config).load_state_dict(state)  # strict: exactly the one-process names
    torch.testing.assert_close(state["tok_emb.weight"], references["epoch"]["final"][TIED], rtol=1e-4, atol=5e-5)


@pytest.mark.slow
def test_tied_head_four_ranks(references, tmp_path) -> None:
    results = spawn(_worker4, 4, tmp_path, timeout=300.0)
    # mesh (pp, dp, cp, tp): ranks 0, 1 run the first stage, 2, 3 the last
    for key in ("pp2_dp2_zero2", "pp2_tp2"):
        _check(results, key, references["gpt2"])
        _copies(results, key, [(0, 2), (1, 3)])
