"""HSDP (replicate x shard) and native CPU offload of ``ZeroStrategy`` on CPU processes (gloo).

HSDP runs as a cluster would launch it: two "nodes" of two processes on this machine, each node
started as its own script with ``NODE_RANK`` and ``MASTER_ADDR`` set (Lightning's launcher starts
the node's second process), ``Trainer(num_nodes=2, devices=2)``, ``replicate_size="auto"``. Its
losses and parameters are those of one process on the same global batch; its sharded checkpoint
resumes on 2 ranks sharded without replication. One 2-process group then compares native offload
with the same run without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _spawn import launch_nodes, spawn
from _zero_toys import DEVICES, NODES, B, fit

HERE = Path(__file__).resolve().parent
HSDP_STEPS = 3  # the node script's
STEPS = 4


def _offload_probe():
    import lightning as L

    from lightning_perf.parallel.sharding.fsdp import is_fsdp_module

    class Probe(L.Callback):
        """After the first step: where the shards and optimizer state live, and FSDP2's offload policy."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx != 1:
                return
            opt = trainer.optimizers[0]
            groups = [m._get_fsdp_state()._fsdp_param_group for m in pl_module.modules() if is_fsdp_module(m)]
            self.seen = {
                "shard_devices": {p.to_local().device.type for p in pl_module.parameters()},
                "shard_pinned": {p.to_local().is_pinned() for p in pl_module.parameters()},
                "state_devices": {t.device.type for s in opt.state.values() for t in s.values()
                                  if torch.is_tensor(t) and t.dim() > 0},
                "policies": {type(g.offload_policy).__name__ for g in groups if g is not None},
                "pin_memory": {getattr(g.offload_policy, "pin_memory", None) for g in groups if g is not None},
            }

    return Probe()


def _worker2(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict
    from lightning_perf.parallel.sharding.ddp import local_optimizer
    from lightning_perf.strategies import ZeroStrategy

    torch.set_num_threads(1)
    res: dict = {}
    runs = {
        "plain3": ZeroStrategy(stage=3),
        "offload3": ZeroStrategy(stage=3, offload_params=True, offload_optimizer=True, backend="native"),
        "plain2": ZeroStrategy(stage=2),
        "offload2": ZeroStrategy(stage=2, offload_optimizer=True, backend="native"),
    }
    # torch's fused CPU AdamW on the offloaded shards (what a GPU run under offload picks by default)
    runs["offload3_fused"] = ZeroStrategy(stage=3, offload_params=True, offload_optimizer=True, backend="native")
    for key, strategy in runs.items():
        probe = _offload_probe()
        trainer, module = fit(strategy, world=world, global_batch=world * B, steps=STEPS, callbacks=[probe],
                              fused_adam=True if key.endswith("_fused") else None)
        res[key] = {"losses": module.losses, "final": full_model_state_dict(module),
                    "seen": getattr(probe, "seen", None),
                    "fused": local_optimizer(trainer.optimizers[0]).defaults.get("fused")}

    # the 2 x 2 HSDP checkpoint, resumed on 2 ranks that shard without replication
    import lightning as L

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = local_optimizer(trainer.optimizers[0])
            self.init = full_model_state_dict(pl_module)
            self.steps = {float(s["step"]) for s in opt.state.values()}
            self.state_numel = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel()
                                   for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())

    start = AtStart()
    _, module = fit(ZeroStrategy(stage=3), world=world, global_batch=world * B, steps=HSDP_STEPS + 1,
                    ckpt_path=str(out / "hsdp.ckpt"), callbacks=[start])
    res["from_hsdp"] = {"init": start.init, "steps": start.steps, "state_numel": start.state_numel,
                        "losses": module.losses}
    return res


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp")
    return out, launch_nodes(HERE / "_zero_toys.py", out, nodes=NODES, devices=DEVICES)


@pytest.fixture(scope="module")
def runs2(two_nodes):
    out, _ = two_nodes
    return spawn(_worker2, 2, out)


def _close(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def _rank_mean(results: list[dict], key=None) -> torch.Tensor:
    return torch.tensor([(r[key] if key else r)["losses"] for r in results]).mean(0)


def test_two_nodes_shard_within_a_node_and_replicate_across(two_nodes) -> None:
    _, ranks = two_nodes
    for r in ranks:
        assert r["world_size"] == 4 and r["global_rank"] == 2 * r["node_rank"] + r["global_rank"] % 2
        mesh = r["mesh"]
        assert mesh["names"] == ("dp_replicate", "dp_shard") and mesh["shape"] == (2, 2)
        node = r["node_rank"]
        assert mesh["groups"]["dp_shard"] == [2 * node, 2 * node + 1]  # the node's two processes
        assert mesh["groups"]["dp_replicate"] == [r["global_rank"] % 2, r["global_rank"] % 2 + 2]  # across nodes
        assert r["placements"] == ["R", "S(0)"]
    n = sum(v.numel() for v in ranks[0]["final"].values())
    assert all(abs(r["local_numel"] - n / 2) <= 64 for r in ranks)  # halves: sharded over 2, not 4


def test_hsdp_2x2_equals_one_process(two_nodes) -> None:
    _, ranks = two_nodes
    _, ref = fit("auto", world=1, global_batch=NODES * DEVICES * B, steps=HSDP_STEPS)
    torch.testing.assert_close(_rank_mean(ranks), torch.tensor(ref.losses), rtol=1e-4, atol=1e-6)
    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict

    expected = full_model_state_dict(ref)
    for r in ranks:
        _close(r["final"], expected, rtol=1e-4, atol=1e-5)


def test_hsdp_checkpoint_resumes_without_replication(two_nodes, runs2) -> None:
    _, ranks = two_nodes
    n = sum(v.numel() for v in ranks[0]["final"].values())
    for r in runs2:
        resumed = r["from_hsdp"]
        _close(resumed["init"], ranks[0]["final"], rtol=0, atol=0)
        assert resumed["steps"] == {float(HSDP_STEPS)}  # Adam's state came with the parameters
        assert abs(resumed["state_numel"] - 2 * n / 2) <= 2 * 64  # both moments, resharded over 2 ranks
        assert len(resumed["losses"]) == 1 and torch.isfinite(torch.tensor(resumed["losses"])).all()


@pytest.mark.parametrize("stage", [2, 3])
def test_native_offload_equals_no_offload(runs2, stage) -> None:
    for r in runs2:
        plain, offload = r[f"plain{stage}"], r[f"offload{stage}"]
        torch.testing.assert_close(torch.tensor(offload["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
        _close(offload["final"], plain["final"], rtol=1e-5, atol=1e-6)
        seen = offload["seen"]
        assert seen["policies"] == {"CPUOffloadPolicy"}
        assert seen["pin_memory"] == {False}  # a CPU device: nothing to pin for
        assert seen["shard_devices"] == {"cpu"} and seen["state_devices"] == {"cpu"}
        assert plain["seen"]["policies"] == {"OffloadPolicy"}  # FSDP2's no-offload default


def test_native_offload_steps_with_the_fused_cpu_adamw(runs2) -> None:
    for r in runs2:
        plain, fused = r["plain3"], r["offload3_fused"]
        assert (plain["fused"], fused["fused"]) == (False, True)
        assert fused["seen"]["state_devices"] == {"cpu"} and fused["seen"]["policies"] == {"CPUOffloadPolicy"}
        torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
        _close(fused["final"], plain["final"], rtol=1e-5, atol=1e-6)


def test_offload_policy_pins_for_an_accelerator() -> None:
    from lightning_perf.parallel.sharding.fsdp import cpu_offload_policy

    assert cpu_offload_policy(torch.device("cuda", 0)).pin_memory is True
    assert cpu_offload_policy(torch.device("cpu")).pin_memory is False
