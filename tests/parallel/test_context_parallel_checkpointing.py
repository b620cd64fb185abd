"""Context-parallel attention under activation checkpointing, on a cp2 group (gloo).

Selective checkpointing must keep what the cp attention's backward reads (the ring's output and
log-sum-exp; the all-gather mode's gathered K / V and SDPA's outputs), so the recomputation of a
block runs no cp communication: during the backward a rank makes exactly the collectives it makes
without checkpointing (the ring's backward pass; the reduce-scatter of dK / dV). Under full
checkpointing the recomputation runs the forward's communication again, and the result must still
be right. Every case trains a tiny GPT a few steps against one process; collectives are counted on
``torch.distributed``'s functions during the first step's forward and backward, eagerly and with the
blocks compiled (``fullgraph=True``: the cp attention traces without a graph break).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _spawn import spawn
from torch.utils.checkpoint import CheckpointPolicy

# the functions each mode's communication goes through (the older names where the newer are missing)
_COUNTED = {
    "ring": ("batch_isend_irecv",),
    "allgather": ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"),
}
N_LAYER = 2


def _tiny_gpt():
    from lightning_perf.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(name="t", vocab_size=64, block_size=16, n_layer=N_LAYER, n_head=4, n_kv_head=2, n_embd=32,
                    intermediate_size=64, pad_vocab_multiple=16, bias=False, positions="rope", norm="rmsnorm",
                    activation="swiglu", tie_embeddings=False)
    return GPT(cfg)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 64, (2, 17), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


class _Counter:
    """Counts calls of ``torch.distributed`` functions (patched in this process) by name."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.calls: dict[str, int] = {}
        self.saved = {}
        for name in names:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)

    def snapshot(self) -> dict[str, int]:
        return dict(self.calls)

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _merge(counts: dict[str, int]) -> dict[str, int]:
    """The older and newer names of one collective as one key."""
    out: dict[str, int] = {}
    for name, n in counts.items():
        key = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}.get(
            name, name)
        out[key] = out.get(key, 0) + n
    return {k: v for k, v in out.items() if v}


def _train(mode: str, ac: str, compiled: bool, world: int) -> dict:
    from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing
    from lightning_perf.parallel.model_parallel.context_parallel import apply_context_parallel

    model = _tiny_gpt()
    apply_activation_checkpointing(list(model.blocks.values()), ac)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    apply_context_parallel(model, mesh["cp"], mode)
    if compiled:
        for block in model.blocks.values():
            block.compile(backend="aot_eager", fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counts = [], {}
    for step, (x, t) in enumerate(_batches()):
        counter = _Counter(_COUNTED[mode]) if step == 0 else None
        try:
            loss = model(x, t)
            if counter is not None:
                forward = counter.snapshot()
            loss.backward()
            if counter is not None:
                total = counter.snapshot()
                counts = {"forward": _merge(forward),
                          "backward": _merge({k: v - forward.get(k, 0) for k, v in total.items()})}
        finally:
            if counter is not None:
                counter.restore()
        for p in model.parameters():  # what the strategy does over (dp, cp)
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "counts": counts}


CASES = [(mode, ac, False) for mode in ("ring", "allgather") for ac in ("none", "selective", "full")]
CASES += [(mode, "selective", True) for mode in ("ring", "allgather")]


def _worker(rank: int, world: int, out: Path) -> dict:
    return {case: _train(*case, world) for case in CASES}


def _reference() -> dict:
    model = _tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, t in _batches():
        loss = model(x, t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_the_cp_ops_stay_out_of_cuda_graphs() -> None:
    import lightning_perf.parallel.model_parallel.context_parallel  # noqa: F401 (defines the ops)

    ops = torch.ops.lightning_perf
    for op in (ops.ring_attention, ops.ring_attention_backward, ops.cp_all_gather, ops.cp_reduce_scatter):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op


def test_selective_policy_keeps_the_cp_ops() -> None:
    import lightning_perf.parallel.model_parallel.context_parallel  # noqa: F401 (defines the ops)
    from lightning_perf.parallel.compute.activation_checkpointing import _selective_policy

    for op in (torch.ops.lightning_perf.ring_attention.default, torch.ops.lightning_perf.cp_all_gather.default,
               torch.ops.aten.mm.default):
        assert _selective_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    # their backward ops run in the backward, never recomputed; elementwise ops are recomputed
    for op in (torch.ops.lightning_perf.ring_attention_backward.default, torch.ops.aten.mul.Tensor):
        assert _selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


@pytest.mark.slow
def test_cp2_checkpointing_recomputes_no_cp_communication(tmp_path) -> None:
    results = spawn(_worker, 2, tmp_path, timeout=240.0, init_group=True)
    ref = _reference()
    for r in results:
        for case in CASES:
            got = r[case]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0,
                                       msg=lambda m: f"{case} losses: {m}")
            for n, p in got["params"].items():
                torch.testing.assert_close(p, ref["params"][n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{case} {n}: {m}")
        # per layer on cp2: the ring's forward passes K / V once; its backward passes K / V once and
        # dK / dV twice. The all-gather mode gathers once forward and reduce-scatters dK / dV backward.
        want = {"ring": ({"batch_isend_irecv": 1}, {"batch_isend_irecv": 3}),
                "allgather": ({"all_gather_single": 1}, {"reduce_scatter_single": 1})}
        for (mode, ac, compiled) in CASES:
            fwd, bwd = ({k: N_LAYER * v for k, v in d.items()} for d in want[mode])
            counts = r[(mode, ac, compiled)]["counts"]
            assert counts["forward"] == fwd, (mode, ac, compiled, counts)
            if ac == "full":  # the recomputation runs the forward's communication again
                bwd = {k: bwd.get(k, 0) + fwd.get(k, 0) for k in {*bwd, *fwd}}
            assert counts["backward"] == bwd, (mode, ac, compiled, counts)
