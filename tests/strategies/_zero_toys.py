"""A tiny GPT whose ranks read disjoint parts of one global batch, for ZeRO runs against one process.

Run as a script it is one "node" of a multi-node launch: ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment, Lightning's launcher starting the node's other process
(``LightningEnvironment``), as ``python _zero_toys.py OUT_DIR`` on each node would on a cluster.
Each rank saves its losses, final parameters and device-mesh layout to ``OUT_DIR/rank{r}.pt``
and the run ends with a sharded checkpoint ``OUT_DIR/hsdp.ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

B, T, VOCAB = 2, 16, 100  # per-rank batch of a 2-rank run, sequence, vocabulary
NODES, DEVICES = 2, 2  # the script's launch: 2 nodes of 2 processes


def tiny_config():
    from lightning_perf.models.gpt import GPTConfig

    # no biases: a k_proj bias has a zero true gradient and Adam would amplify rounding noise
    return GPTConfig(name="t", vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32,
                     pad_vocab_multiple=16, bias=False)


def make_module(global_batch: int, steps: int, fused_adam=None):
    """A GPTLightningModule (constant LR) recording its losses; rank r of W reads rows
    ``k * global_batch + r * global_batch / W + j`` at step k, so the ranks' union is one batch."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from lightning_perf.models.gpt.module import GPTLightningModule

    class Recording(GPTLightningModule):
        def __init__(self) -> None:
            super().__init__(tiny_config(), learning_rate=1e-3, warmup_steps=0, min_lr_ratio=1.0,
                             fused_adam=fused_adam)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float().item())
            return loss

        def train_dataloader(self):
            world, rank = self.trainer.world_size, self.trainer.global_rank
            per_rank = global_batch // world
            g = torch.Generator().manual_seed(7)
            data = torch.randint(0, VOCAB, (steps * global_batch, T + 1), generator=g)
            rows = [k * global_batch + rank * per_rank + j for k in range(steps) for j in range(per_rank)]
            return DataLoader(Subset(TensorDataset(data[:, :-1], data[:, 1:]), rows), batch_size=per_rank)

    return Recording()


def fit(strategy: Any, *, world: int, global_batch: int, steps: int, num_nodes: int = 1, ckpt_path=None,
        callbacks=None, fused_adam=None) -> tuple[Any, Any]:
    """``Trainer.fit`` of the tiny module; returns (trainer, module)."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    module = make_module(global_batch, steps, fused_adam)
    trainer = L.Trainer(accelerator="cpu", devices=world // num_nodes, num_nodes=num_nodes, strategy=strategy,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False, callbacks=callbacks or [])
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def mesh_layout(mesh: Any) -> dict[str, Any]:
    """This rank's mesh: dimension names, shape, and the ranks of its group along each dimension."""
    names = mesh.mesh_dim_names
    return {"names": names, "shape": tuple(mesh.shape),
            "groups": {n: mesh[n].mesh.flatten().tolist() for n in names}}


def _main(out: Path) -> None:
    import os

    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict
    from lightning_perf.strategies import ZeroStrategy

    torch.set_num_threads(1)
    steps = 3
    trainer, module = fit(ZeroStrategy(stage=3, replicate_size="auto"), world=NODES * DEVICES,
                          global_batch=NODES * DEVICES * B, num_nodes=NODES, steps=steps)
    strategy = trainer.strategy
    param = next(iter(module.parameters()))
    result = {
        "node_rank": int(os.environ["NODE_RANK"]), "global_rank": trainer.global_rank,
        "world_size": trainer.world_size, "mesh": mesh_layout(strategy.device_mesh),
        "placements": [str(p) for p in param.placements],
        "local_numel": sum(p.to_local().numel() for p in module.parameters()),
        "losses": module.losses, "final": full_model_state_dict(module),
    }
    trainer.save_checkpoint(out / "hsdp.ckpt")
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
