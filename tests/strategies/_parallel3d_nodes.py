"""One node of a two-node launch of ``Parallel3DStrategy(replicate_size="auto")``, as a cluster runs it.

``python _parallel3d_nodes.py OUT_DIR`` on each node, with ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment; Lightning's launcher starts the node's second process
(``LightningEnvironment``), ``Trainer(num_nodes=2, devices=2)``. The processes train the tiny
Llama-style GPT of ``test_parallel3d`` for one epoch per layout, in turn on the same process group:

- ``hsdp``: dp4 with ZeRO 3, "auto" resolving to replicate 2 (the nodes) x shard 2 (a node's processes);
- ``tp2_hsdp``: tp2 within a node x dp2 with ZeRO 3, "auto" resolving to replicate 2 x shard 1.

Each rank saves, per layout, its losses, final parameters, mesh and parameter placements to
``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the helpers test_parallel3d imports

NODES, DEVICES = 2, 2
#: layout name -> (Parallel3DStrategy arguments besides replicate_size="auto", dp size)
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "hsdp": ({"zero_stage": 3}, 4),
    "tp2_hsdp": ({"tensor_parallel_size": 2, "zero_stage": 3}, 2),
}
DIMS = ("pp", "dp_replicate", "dp_shard", "dp", "cp", "tp")


def layout(strategy: Any) -> dict[str, Any]:
    """The mesh this rank built: dimension names and shape, its coordinate and group along each
    dimension, and the (mesh, placements) of its parameters."""
    mesh = strategy.device_mesh
    params = list(strategy.lightning_module.parameters())
    return {
        "names": mesh.mesh_dim_names, "shape": tuple(mesh.shape),
        "coords": {n: mesh[n].get_local_rank() for n in DIMS},
        "groups": {n: mesh[n].mesh.flatten().tolist() for n in DIMS},
        "sampler": strategy.distributed_sampler_kwargs,
        "params": {(p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) for p in params},
        "local_numel": sum(p.to_local().numel() for p in params),
    }


def _main(out: Path) -> None:
    from test_parallel3d import PER_EPOCH, S, fit

    torch.set_num_threads(1)
    res: dict[str, Any] = {"node_rank": int(os.environ["NODE_RANK"])}
    for key, (kwargs, dp) in LAYOUTS.items():
        strategy = S(replicate_size="auto", **kwargs)
        res[key] = fit(strategy, NODES * DEVICES, dp=dp, steps=PER_EPOCH, num_nodes=NODES)
        res[key].update(layout(strategy), global_rank=strategy.global_rank, world_size=strategy.world_size)
    torch.save(res, out / f"rank{res['hsdp']['global_rank']}.pt")


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
