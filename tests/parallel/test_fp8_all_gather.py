"""FSDP2 gathering FP8 weights (``apply_fsdp(fp8_all_gather=True)``, torchao) on 2 CPU processes (gloo).

The FP8 gather quantises each shard with the whole weight's scale, which is the FP8 tensor the
plain path makes after gathering: with fp32 master weights (no mixed precision) losses and
parameters must equal ZeRO with FP8 linears and a plain gather exactly, with the scales reduced at
each gather or precomputed after each optimizer step, at ZeRO-2 and ZeRO-3, through a checkpoint
and under a compiled block.
"""

from __future__ import annotations

from pathlib import Path

import torch
from _spawn import spawn as _spawn

from lightning_perf.models.gpt import GPT, GPTConfig

WORLD = 2
STEPS = 3
B, T = 2, 16
LR = 1e-2


def config() -> GPTConfig:
    # n_embd 48: the 4 * 48 = 192 MLP rows and 3 * 48 q/k/v rows split evenly; vocab 100 -> 112 unevenly
    return GPTConfig(name="t", vocab_size=100, block_size=T, n_layer=2, n_head=2, n_embd=48, pad_vocab_multiple=16,
                     bias=False, fp8=True)


def data(world: int):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 100, (world * B, T + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _run(rank: int, world: int, *, stage: int, gather: bool, precompute: bool, compile_blocks: bool = False,
         ckpt: Path | None = None, precompute_once: bool = False, ac: str = "none", meta: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_perf.parallel import apply_fsdp, load_checkpoint, save_checkpoint
    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    from lightning_perf.parallel.sharding.fp8_all_gather import fp8_all_gather_weights, precompute_fp8_scales
    from lightning_perf.parallel.sharding.init import materialize_from_rank0, take_full_state

    from lightning_perf.kernels import torchao_fp8 as float8
    from lightning_perf.kernels.torchao_fp8 import is_fp8_linear

    # both sides on torchao's matmul (a plain weight would otherwise take kernels.ops.fp8_linear, an
    # FP8-gathered one cannot): the comparison is of the gathers
    float8._pack_path = lambda x, weight: False
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))

    def build():
        torch.manual_seed(0)
        if meta:  # every rank initialises its own shards (init="meta")
            from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing
            from lightning_perf.parallel.sharding.init import materialize_local

            with torch.device("meta"):
                model = GPT(config())
            apply_activation_checkpointing(list(model.blocks.values()), ac)
            apply_fsdp(model, mesh, reshard_after_forward=stage == 3, fp8_all_gather=gather)
            torch.manual_seed(100 + rank)
            materialize_local(model, torch.device("cpu"))
            return model
        if rank == 0:
            model = GPT(config())
            full = take_full_state(model)
        else:
            with torch.device("meta"):
                model = GPT(config())
            full = None
        if compile_blocks:
            for block in model.blocks.values():
                block.compile(backend="aot_eager")
        if ac != "none":
            from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(list(model.blocks.values()), ac)
        apply_fsdp(model, mesh, reshard_after_forward=stage == 3, fp8_all_gather=gather)
        materialize_from_rank0(model, torch.device("cpu"), full)
        return model

    model = build()
    out: dict = {"n_fp8": len(fp8_all_gather_weights(model))}
    if gather:
        p = fp8_all_gather_weights(model)[0]
        out["local_type"] = type(p._local_tensor).__name__
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if precompute_once:  # scales and FP8 shards made once, then the optimizer steps without a precompute
        precompute_fp8_scales(model)
    seen_gathered = []
    if gather:  # the Float8Linear receives the gathered FP8 weight itself
        mods = [m for m in model.modules() if is_fp8_linear(m)]
        mods[0].register_forward_pre_hook(lambda m, a: seen_gathered.append(tensor_already_casted_to_fp8(m.weight)))
    def train(model, opt, batches, on_step=None) -> list[float]:
        """Each rank its slice of every batch; the mean loss over ranks per step."""
        losses = []
        for i, (x, y) in enumerate(batches):
            loss = model(x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                assert precompute_fp8_scales(model) == out["n_fp8"]
            l = loss.detach().clone()
            dist.all_reduce(l)
            losses.append(l.item() / world)
            if on_step is not None:
                on_step(i)
        return losses

    batches = data(world)
    save = (lambda i: save_checkpoint(ckpt, model, [opt], extra={"step": 1}) if i == 0 else None) if ckpt else None
    out["losses"] = train(model, opt, batches, save)
    out["final"] = full_model_state_dict(model)
    out["final_types"] = sorted({type(v).__name__ for v in out["final"].values()})
    out["seen_gathered"] = seen_gathered
    if ckpt is not None:  # a fresh FP8-gathering model resumes from step 1
        model2 = build()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
        extra = load_checkpoint(ckpt, model2, [opt2])
        if precompute:
            precompute_fp8_scales(model2)
        out["resumed"] = train(model2, opt2, batches[extra["step"]:])
    return out


def _worker(rank: int, world: int, out_dir: Path) -> dict:
    res = {
        "zero3_plain": _run(rank, world, stage=3, gather=False, precompute=False),
        "zero3_gather": _run(rank, world, stage=3, gather=True, precompute=False, ckpt=out_dir / "ckpt3"),
        "zero3_gather_pre": _run(rank, world, stage=3, gather=True, precompute=True),
        "zero2_gather_pre": _run(rank, world, stage=2, gather=True, precompute=True, ckpt=out_dir / "ckpt2"),
        "zero3_gather_compiled": _run(rank, world, stage=3, gather=True, precompute=True, compile_blocks=True),
        "zero3_gather_stale": _run(rank, world, stage=3, gather=True, precompute=False, precompute_once=True),
        # activation checkpointing recomputes the forward with the re-gathered FP8 weight
        "zero3_gather_ac": _run(rank, world, stage=3, gather=True, precompute=True, ac="full"),
        # meta-device init: the shards are initialised in place through the wrapper
        "zero3_meta_plain": _run(rank, world, stage=3, gather=False, precompute=False, meta=True),
        "zero3_meta_gather": _run(rank, world, stage=3, gather=True, precompute=True, meta=True),
    }
    # bad input: no FP8 linears to gather, before any collective
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_perf.parallel import apply_fsdp

    plain = GPT(GPTConfig(name="t", vocab_size=100, block_size=T, n_layer=1, n_head=2, n_embd=32))
    try:
        apply_fsdp(plain, init_device_mesh("cpu", (world,)), fp8_all_gather=True)
        res["error"] = None
    except ValueError as e:
        res["error"] = str(e)
    return res


def test_fp8_all_gather_equals_plain_gather(tmp_path: Path) -> None:
    results = _spawn(_worker, WORLD, tmp_path, timeout=240.0, init_group=True)
    r = results[0]
    ref = r["zero3_plain"]
    assert ref["n_fp8"] == 0
    n_linear = 2 * 4  # q/k/v, o, fc, proj per block (fused q/k/v off: q, k, v separate -> more)
    for name in ("zero3_gather", "zero3_gather_pre", "zero2_gather_pre", "zero3_gather_compiled", "zero3_gather_ac"):
        got = r[name]
        assert got["local_type"] == "WeightWithDynamicFloat8CastTensor"
        assert got["n_fp8"] >= n_linear
        assert got["seen_gathered"] and all(got["seen_gathered"]), name
        assert got["losses"] == ref["losses"], name  # bit for bit
        assert got["final_types"] == ["Tensor"]  # state dicts hold plain tensors
        for k, v in ref["final"].items():
            assert torch.equal(got["final"][k], v), f"{name}: {k}"
    # weights stepped without a precompute: gathered as they are now (with the older scale), not as
    # they were at the precompute: step 0 equals, later steps track the plain run to FP8 resolution
    stale = r["zero3_gather_stale"]["losses"]
    assert stale[0] == ref["losses"][0]
    moved = abs(ref["losses"][-1] - ref["losses"][0])
    assert max(abs(a - b) for a, b in zip(stale, ref["losses"])) < 0.05 * moved
    meta_plain, meta_gather = r["zero3_meta_plain"], r["zero3_meta_gather"]
    assert meta_gather["losses"] == meta_plain["losses"] and meta_plain["losses"] != ref["losses"]
    for k, v in meta_plain["final"].items():
        assert torch.equal(meta_gather["final"][k], v), k
    # resumed from the step-1 checkpoint == uninterrupted
    assert r["zero3_gather"]["resumed"] == ref["losses"][1:]
    assert r["zero2_gather_pre"]["resumed"] == ref["losses"][1:]
    for rr in results:
        assert rr["error"] is not None and "no FP8 linear layers" in rr["error"]


# ---- one process, no collectives ------------------------------------------------------------------


def test_only_tensorwise_linears_gather_in_fp8() -> None:
    import pytest

    from lightning_perf.parallel.sharding.fp8_all_gather import (
        enable_fp8_all_gather,
        require_fp8_config,
        require_fp8_linears,
    )

    rowwise = GPT(GPTConfig(name="t", vocab_size=100, block_size=T, n_layer=1, n_head=2, n_embd=48, fp8="rowwise"))
    with pytest.raises(ValueError, match="needs tensorwise FP8 linears"):
        require_fp8_linears(rowwise)
    assert enable_fp8_all_gather(rowwise) == []
    tensorwise = GPT(config())
    require_fp8_linears(tensorwise)
    names = enable_fp8_all_gather(tensorwise)
    assert len(names) == 2 * 6 and all(n.startswith("blocks.") for n in names)  # q k v o up down, per block
    assert enable_fp8_all_gather(tensorwise) == []  # already on

    class Holder(torch.nn.Module):
        def __init__(self, fp8):
            super().__init__()
            self.config = GPTConfig(name="t", vocab_size=100, block_size=T, n_layer=1, n_head=2, n_embd=48, fp8=fp8)

    require_fp8_config(Holder(True))
    for fp8, match in ((False, "has fp8=False"), ("rowwise", "needs tensorwise")):
        with pytest.raises(ValueError, match=match):
            require_fp8_config(Holder(fp8))
