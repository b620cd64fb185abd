"""A user's own model under ``Parallel3DStrategy``: implement two methods, get TP and PP.

    python examples/user_model_3d.py --tp 2           # tensor parallel on 2 CPU processes
    python examples/user_model_3d.py --pp 2           # two pipeline stages (1F1B)
    python examples/user_model_3d.py --pp 2 --dp 2    # 4 processes: pipeline x data parallel

The model is a small residual-MLP language model (no attention, to keep it short):
embedding -> N blocks ``x + down(gelu(up(norm(x))))`` -> norm -> head. The protocol:

- ``tensor_parallel_plan(tp_mesh)``: a ``parallelize_module`` plan. Column-parallel ``up``,
  row-parallel ``down`` (one all-reduce per block), a vocab-parallel embedding, and a
  head whose logits are gathered (so the ``training_step`` below sees plain logits).
- ``pipeline_stage(i, n)``: a module running stage ``i`` of ``n``: the first stage owns the
  embedding, the last the norm and head; blocks keep their names (``blocks.<k>``), so a
  checkpoint saved under one layout loads under another.

Under pipeline parallelism the strategy makes ``model(inputs, targets)`` run the schedule
and return the loss, so ``training_step`` needs no change. Without the protocol, a model
still gets data parallelism / ZeRO; asking for tp or pp raises a ``ValueError`` naming the
missing method.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.strategies import Parallel3DStrategy


class ResidualMLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, n_layer: int = 4) -> None:
        super().__init__()
        self.embed: Optional[nn.Embedding] = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleDict({str(i): ResidualMLPBlock(d) for i in range(n_layer)})
        self.norm: Optional[nn.LayerNorm] = nn.LayerNorm(d)
        self.head: Optional[nn.Linear] = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)  # token ids (B, T) -> (B, T, d); later stages get hidden states
        for block in self.blocks.values():
            x = block(x)
        if self.head is None:
            return x  # an inner pipeline stage hands hidden states on
        logits = self.head(self.norm(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    # ---- the 3D protocol ----------------------------------------------------------------------

    def tensor_parallel_plan(self, tp_mesh: Any) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        if self.embed is not None:
            plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        for key in self.blocks:
            plan[f"blocks.{key}.up"] = ColwiseParallel()
            plan[f"blocks.{key}.down"] = RowwiseParallel()
        if self.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Replicate())  # gathered logits
        return plan

    def pipeline_stage(self, stage_idx: int, num_stages: int) -> "TinyLM":
        keys = list(self.blocks)
        if len(keys) % num_stages:
            raise ValueError(f"{len(keys)} blocks do not split into {num_stages} stages")
        per = len(keys) // num_stages
        stage = TinyLM.__new__(TinyLM)
        nn.Module.__init__(stage)
        stage.embed = self.embed if stage_idx == 0 else None
        stage.blocks = nn.ModuleDict({k: self.blocks[k] for k in keys[stage_idx * per : (stage_idx + 1) * per]})
        last = stage_idx == num_stages - 1
        stage.norm = self.norm if last else None
        stage.head = self.head if last else None
        return stage


class LitTinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Optional[TinyLM] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TinyLM()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)  # under pipeline parallelism: runs the whole schedule
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args()
    world = a.dp * a.tp * a.pp
    L.seed_everything(0)  # every rank builds the same model (it is split after)
    strategy = Parallel3DStrategy(
        data_parallel_size=a.dp, tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp,
        pipeline_schedule="1f1b", num_microbatches=4 if a.pp > 1 else None,
    )
    tokens = torch.randint(0, 256, (512, 33), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8, drop_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=a.steps,
                        logger=False, enable_checkpointing=False)
    trainer.fit(LitTinyLM(), data)


if __name__ == "__main__":
    main()
