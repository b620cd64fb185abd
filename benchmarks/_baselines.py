"""The baselines a user would pick instead of the pack, shared by the benchmarks.

:func:`plain_training_loop` is the single-GPU one: the plain PyTorch loop a user writes around a
compiled model (``bench_gpt.py`` and ``bench_recipes.py`` time their plain side with it). For a
step: the batch moved to the device, the loss under bf16 autocast, backward, clipping by norm
when asked, the optimizer step, ``zero_grad(set_to_none=True)``, the learning-rate schedule when
given; timed by the same wall-clock window as every headline (``_timing.Window``).

The multi-GPU one is the strongest a Lightning user would pick today: ``ModelParallelStrategy`` + FSDP2.

Lightning's ``ModelParallelStrategy`` leaves the parallelism to the module's ``configure_model``;
:class:`ModelParallelGPT` does there what torchtitan and Lightning's own FSDP2 examples do: the
same GPT shape as the pack's (PyTorch kernels, SDPA attention, no FP8, separate q/k/v), built on
``meta``, each block compiled with ``torch.compile`` and then sharded with ``fully_shard`` over the
data-parallel mesh (parameters resharded after forward), the root sharded last, fp32 master weights
with bf16 compute and fp32 gradient reduction (``MixedPrecisionPolicy``), the parameters
materialised shard by shard, fused AdamW, and full activation checkpointing per block where asked
(Lightning has no selective mode). The Trainer runs it at ``precision="32-true"``: the policy does
the casting, no autocast.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import lightning as L
import torch

__all__ = ["ModelParallelGPT", "model_parallel_strategy", "plain_gpt_config", "plain_training_loop"]


def plain_training_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any], *,
                        steps: int, warmup: int, device: torch.device, tokens_per_step: int, amp: bool = True,
                        clip: Optional[float] = None, schedule: Any = None, profile_steps: int = 0,
                        profile_trace: Optional[str] = None) -> dict[str, Any]:
    """``warmup + steps`` steps of the plain loop over ``model(x, y) -> loss`` on ``(x, y)`` batches from
    ``batches``; the window (:class:`_timing.Window`) over the last ``steps``. ``amp``: bf16 autocast on
    the device; ``clip``: ``clip_grad_norm_`` before the step; ``schedule``: stepped after every step;
    ``profile_steps``: the last N steps under ``torch.profiler``, summarised under ``"profile"``
    (:class:`_timing.StepProfile`, its trace at ``profile_trace``). Returns the window's result."""
    from _timing import StepProfile, Window

    if steps < 1 or warmup < 0 or not 0 <= profile_steps <= steps:
        raise ValueError(f"steps={steps}, warmup={warmup}, profile_steps={profile_steps}: at least one timed "
                         f"step, and at most that many profiled")
    total = warmup + steps
    window = Window(device.type == "cuda", first_step=warmup)
    profile = StepProfile(profile_steps) if profile_steps else None
    for i in range(total):
        if profile is not None and i == total - profile_steps:
            profile.start()
        if i == warmup:
            window.open()
        if window.is_open:
            window.step(tokens_per_step)
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
    result = window.close()
    if profile is not None:
        return {"profile": profile.stop(profile_trace), **result}
    return result


def plain_gpt_config(config: Any) -> Any:
    """The same GPT shape with PyTorch's own kernels: what a user has before the pack."""
    return config.replace(kernels="torch", attention="sdpa", fp8=False, fused_qkv=False)


def model_parallel_strategy(world: int) -> Any:
    """Lightning's ModelParallelStrategy as pure FSDP2 over ``world`` devices (no tensor parallelism)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


class ModelParallelGPT(L.LightningModule):
    """A GPT under Lightning's ModelParallelStrategy: per-block compile + FSDP2 in ``configure_model``.

    Args:
        config: a ``GPTConfig``; its kernels, attention, FP8 and fused q/k/v are reset to PyTorch's.
        compile: ``torch.compile`` each block (``"default"``) or not (None).
        activation_checkpointing: ``"full"`` per block (``checkpoint_wrapper``), or ``"none"``.
        learning_rate, weight_decay: AdamW's; decay on matrices only.
    """

    def __init__(self, config: Any, *, compile: Any = "default", activation_checkpointing: str = "none",
                 learning_rate: float = 3e-4, weight_decay: float = 0.1) -> None:
        super().__init__()
        if activation_checkpointing not in ("none", "full"):
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r}: 'none' or 'full'")
        self.config = plain_gpt_config(config)
        self.compile_mode = compile
        self.ac = activation_checkpointing
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lightning_perf.models.gpt.model import GPT

        with torch.device("meta"):
            model = GPT(self.config)
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, block in list(model.blocks.items()):
            if self.ac == "full":
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

                block = checkpoint_wrapper(block)
            if self.compile_mode:
                block = torch.compile(block, mode=None if self.compile_mode == "default" else self.compile_mode)
            model.blocks[name] = block
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        model.to_empty(device=self.trainer.strategy.root_device)
        with torch.no_grad():
            model.init_weights()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: Any = None) -> torch.Tensor:
        return self.model(idx, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.log("train/loss", loss.detach(), prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        other = [p for p in self.model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": other, "weight_decay": 0.0}]
        fused = next(iter(self.model.parameters())).device.type == "cuda"
        return torch.optim.AdamW(groups, lr=self.learning_rate, betas=(0.9, 0.95), fused=fused)

