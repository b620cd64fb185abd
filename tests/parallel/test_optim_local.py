"""Adam / AdamW stepping FSDP2-sharded parameters through their local shards equals the DTensor step."""

from __future__ import annotations

import pytest
import torch


def _local_step_worker(rank: int, world: int, out_dir) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.sharding.optim import is_localized, localize_optimizer

    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig.from_name("tiny", n_layer=2)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    for cls_name, fused in (("AdamW", False), ("AdamW", True), ("Adam", False)):
        runs = {}
        for local in (False, True):
            torch.manual_seed(0)
            model = GPT(cfg)
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            cls = getattr(torch.optim, cls_name)
            opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused, foreach=None if fused else True,
                      amsgrad=cls_name == "Adam")
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            if local:
                assert localize_optimizer(opt) and is_localized(opt)
                assert isinstance(opt, cls) and type(opt).__name__ == cls_name
            for _ in range(3):
                model(idx, idx).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
            params = [p.full_tensor() for p in model.parameters()]
            states = [v.full_tensor() if isinstance(v, DTensor) else v
                      for s in opt.state.values() for k, v in sorted(s.items())]
            runs[local] = {"params": params, "states": states, "local_groups": getattr(opt, "local_groups", 0),
                           "state_is_dtensor": all(isinstance(s["exp_avg"], DTensor) for s in opt.state.values())}
        out[f"{cls_name} fused={fused}"] = runs
    # a Partial gradient (a pending reduction) keeps the DTensor path, which reduces it
    w = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]))
    w.grad = DTensor.from_local(torch.full((4, 3), float(rank + 1)), mesh, [Partial()])
    opt = torch.optim.SGD([w], lr=0.1)
    assert not localize_optimizer(opt)  # not an Adam: left alone
    opt = torch.optim.Adam([w], lr=0.1)
    localize_optimizer(opt)
    opt.step()
    out["partial"] = {"w": w.full_tensor(), "local_groups": getattr(opt, "local_groups", 0)}
    return out


def test_local_shard_adam_equals_the_dtensor_step(tmp_path) -> None:
    """FSDP2 over 2 processes, tiny GPT, 3 steps with a learning-rate schedule: Adam/AdamW (foreach,
    fused, amsgrad) stepping through the local shards give bit-identical parameters and optimizer
    state to the DTensor step, the state stays DTensor (checkpoints unchanged), and a gradient with a
    pending Partial reduction keeps the DTensor path."""
    from tests._spawn import spawn

    for r in spawn(_local_step_worker, 2, tmp_path, init_group=True):
        for name, runs in ((k, v) for k, v in r.items() if k != "partial"):
            ref, loc = runs[False], runs[True]
            assert loc["local_groups"] > 0 and ref["local_groups"] == 0, name
            assert loc["state_is_dtensor"], name
            assert len(ref["params"]) == len(loc["params"]) and len(ref["states"]) == len(loc["states"])
            for a, b in zip(ref["params"] + ref["states"], loc["params"] + loc["states"]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        partial = r["partial"]
        assert partial["local_groups"] == 0
        # grads 1 and 2 summed: 3 everywhere; Adam's first step moves every element by lr
        torch.testing.assert_close(partial["w"], torch.full((4, 3), 0.9))


@pytest.mark.parametrize("name", ["SGD", "RMSprop"])
def test_other_optimizers_are_left_alone(name) -> None:
    from lightning_perf.parallel.sharding.optim import localize_optimizer

    opt = getattr(torch.optim, name)([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert not localize_optimizer(opt) and type(opt) is getattr(torch.optim, name)
