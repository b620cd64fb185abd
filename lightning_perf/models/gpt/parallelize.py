"""How the GPT splits for tensor and pipeline parallelism.

``GPT.tensor_parallel_plan`` and ``GPT.pipeline_stage`` delegate here; the model file
itself knows nothing of parallelism. The strategy (``Parallel3DStrategy``) calls the
two protocol methods and composes them with FSDP2 in ``lightning_perf.parallel``.

Tensor parallelism (column-parallel then row-parallel linears, with sequence parallelism by default)::

    tok_emb   vocab-parallel embedding          -> (B, T/tp, d)   [sequence sharded]
    pos_emb   rows (positions) sharded          -> (T/tp, d)
    per block:
      attn_norm / mlp_norm  sequence parallel   (B, T/tp, d) -> (B, T/tp, d)
      attn / mlp input      all-gather sequence (B, T/tp, d) -> (B, T, d)
      q/k/v, up/gate        column parallel     (B, T, d) -> (B, T, heads/tp * hd)
      o_proj, down_proj     row parallel        -> reduce-scatter to (B, T/tp, d)
    norm      sequence parallel, output gathered to a replicated DTensor (B, T, d)
    head      vocab-parallel: logits DTensor (B, T, V/tp), loss via loss_parallel

Attention reads its local head count from the projection width, so grouped-query
attention needs only ``n_head % tp == 0`` and ``n_kv_head % tp == 0``.

Pipeline parallelism: stage ``i`` of ``n`` keeps a contiguous run of blocks under their
original ``blocks.<k>`` names (so checkpoints reshard across layouts); the first stage
owns the embeddings, the last the final norm, head and loss. The head is not free: at
gpt-1.3b (V=50k, d=2048) its matmul is worth ~1.9 blocks, so an even split of 24 blocks
gives the last stage ~15% more matmul work than the first, and every 1F1B step waits on it.
:func:`gpt_stage_layers` therefore balances matmul FLOPs (blocks + head) over the
stages: gpt-1.3b on 2 stages gets 13 + 11 blocks. A tied head lives on both the
first and the last stage: the last stage's ``lm_head`` is the token embedding module
itself, so each of the two pipeline ranks holds a copy of the one ``tok_emb.weight``
(the strategy keeps the copies equal: ``lightning_perf.parallel.model_parallel.tied``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from lightning_perf.kernels.dtensor import is_dtensor
from lightning_perf.kernels.torchao_fp8 import fp8_recipe_of
from lightning_perf.models.gpt.config import GPTConfig
from lightning_perf.parallel.model_parallel.tensor_parallel import (
    ReplicatedModule,
    ReplicatedOutputNorm,
    residual_layout,
)

__all__ = ["gpt_tensor_parallel_plan", "gpt_pipeline_stage", "gpt_stage_layers"]


def _fp8_collectives(tp_mesh: Any) -> bool:
    """Whether the mesh's backend moves FP8 tensors (NCCL does; gloo has no FP8 types)."""
    return tp_mesh.device_type != "cpu"


def gpt_tensor_parallel_plan(model: nn.Module, tp_mesh: Any, *, sequence_parallel: Any = True) -> dict[str, Any]:
    """The ``parallelize_module`` plan for ``model`` (a whole GPT or one pipeline stage of it).

    ``sequence_parallel``: True shards the residual stream (and the norms) along the sequence,
    ``"batch"`` along the batch (whole sequences per rank; collectives on the leading dimension,
    see :func:`lightning_perf.parallel.model_parallel.tensor_parallel.residual_layout`), False replicates it.
    Whether the GPT splits over ``tp_mesh`` at all (heads divisible by its size, ...) is its
    config's ``check_parallel_layout``, which the strategy asks before any process group exists.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # the residual stream between modules: sharded local tensors, or replicated ones
    resid = residual_layout(sequence_parallel)
    sharded = sequence_parallel is not False
    by_batch = sequence_parallel == "batch"
    plan: dict[str, Any] = {}
    if model.tok_emb is not None:
        with_positions = model.pos_emb is not None and sharded
        # with a position table under batch sharding, the token rows stay a DTensor until the
        # positions are added (below): the table's gradient then sums over every rank's sequences
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=resid,
                                          use_local_output=not (with_positions and by_batch))
        if with_positions and not by_batch:
            # (T, d) position rows: sharded like the sequence so they add to (B, T/tp, d)
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        elif with_positions:
            # every rank holds whole sequences: the whole (T, d) table, replicated (a DTensor, added
            # to the batch-sharded token rows), then plain local tensors from the first block on
            plan["pos_emb"] = ReplicatedModule()
            first = next(iter(model.blocks))
            plan[f"blocks.{first}"] = PrepareModuleInput(input_layouts=(resid, None),
                                                         desired_input_layouts=(resid, None), use_local_output=True)
    seq_dim = resid.dim if sharded else 1
    for key, block in model.blocks.items():
        p = f"blocks.{key}"
        # tensorwise FP8 linears: torchao's styles cast the block input to FP8 before its all-gather
        # (and the gradients before theirs). Elsewhere the plain styles: the FP8 linears then take
        # DTensors and reduce each scale over the TP group, and the collectives move bf16/fp32
        Colwise, Rowwise, Prepare, prepare_kw = ColwiseParallel, RowwiseParallel, PrepareModuleInput, {}
        if fp8_recipe_of(block.attn.q_proj) == "tensorwise" and _fp8_collectives(tp_mesh):
            from torchao.float8.float8_tensor_parallel import (
                Float8ColwiseParallel,
                Float8RowwiseParallel,
                PrepareFloat8ModuleInput,
            )

            Colwise, Rowwise, Prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
            prepare_kw = {"float8_dtype": torch.float8_e4m3fn}
        plan[f"{p}.attn.q_proj"] = Colwise()
        plan[f"{p}.attn.k_proj"] = Colwise()
        plan[f"{p}.attn.v_proj"] = Colwise()
        plan[f"{p}.attn.o_proj"] = Rowwise(output_layouts=resid)
        plan[f"{p}.mlp.up_proj"] = Colwise()
        if block.mlp.gate_proj is not None:
            plan[f"{p}.mlp.gate_proj"] = Colwise()
        plan[f"{p}.mlp.down_proj"] = Rowwise(output_layouts=resid)
        if sharded:
            plan[f"{p}.attn_norm"] = SequenceParallel(sequence_dim=seq_dim)
            plan[f"{p}.mlp_norm"] = SequenceParallel(sequence_dim=seq_dim)
            # the rope tables (second input) stay plain tensors
            fqn = {"fwd_config_submodule_fqn": "q_proj"} if prepare_kw else {}
            plan[f"{p}.attn"] = Prepare(
                input_layouts=(resid, None), desired_input_layouts=(Replicate(), None), **prepare_kw, **fqn
            )
            fqn = {"fwd_config_submodule_fqn": "up_proj"} if prepare_kw else {}
            plan[f"{p}.mlp"] = Prepare(input_layouts=(resid,), desired_input_layouts=(Replicate(),), **prepare_kw, **fqn)
    if model.norm is not None:
        plan["norm"] = ReplicatedOutputNorm(sequence_parallel=sequence_parallel)
        if isinstance(model.lm_head, nn.Embedding):
            # a tied head on the last pipeline stage: vocabulary rows sharded as the first stage's
            # tok_emb, shard for shard; already sharded where that stage runs in this process
            if not is_dtensor(model.lm_head.weight):
                plan["lm_head"] = RowwiseParallel(input_layouts=Replicate())
        elif model.lm_head is not None:
            # only the weight's sharding matters: forward uses it through F.linear (head_weight)
            plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def _head_in_blocks(config: GPTConfig) -> float:
    """The last stage's extra matmul work (LM head) in units of one block's, per token."""
    d, hd = config.n_embd, config.head_dim
    attn = 2 * d * config.n_head * hd + 2 * d * config.n_kv_head * hd
    mlp = (3 if config.activation == "swiglu" else 2) * d * config.intermediate_size
    block = attn + mlp + d * config.block_size  # + attention scores (causal, counted once)
    return config.padded_vocab_size * d / block


def gpt_stage_layers(config: GPTConfig, num_stages: int) -> list[int]:
    """Blocks per pipeline stage, balancing matmul FLOPs with the LM head on the last stage.

    The last stage gets ``round((L + h) / n - h)`` blocks (``h``: the head in block units,
    at least 1 block, at most ``L - (n-1)``); the others share the rest as evenly as
    possible, earlier stages taking the remainder. ``L = 24, n = 2, h ~ 1.9`` gives [13, 11].
    """
    L, n = config.n_layer, num_stages
    if n < 1 or L < n:
        raise ValueError(f"{L} blocks cannot fill {n} pipeline stages (each needs at least one)")
    if n == 1:
        return [L]
    h = _head_in_blocks(config)
    last = min(max(1, round((L + h) / n - h)), L - (n - 1))
    rest, extra = divmod(L - last, n - 1)
    return [rest + (1 if i < extra else 0) for i in range(n - 1)] + [last]


def gpt_pipeline_stage(model: nn.Module, stage_idx: int, num_stages: int) -> nn.Module:
    """A GPT holding stage ``stage_idx`` of ``num_stages``: the same module objects, original names.

    The returned stage shares its submodules (and so its parameters) with ``model``.
    Its ``forward(x)`` takes token ids on the first stage and hidden states (B, T, d)
    elsewhere, and returns hidden states (B, T, d): on the last stage the final norm's output, which its
    ``pipeline_loss(x, targets)`` turns into the loss through the head (``lm_head_loss``). With a tied
    head the first and the last stage share ``model.tok_emb`` (the last as its ``lm_head``). The stage is
    an instance of ``model``'s class, built without running its ``__init__``.
    """
    if not 0 <= stage_idx < num_stages:
        raise ValueError(f"stage_idx {stage_idx} is outside 0..{num_stages - 1}")
    keys = list(model.blocks.keys())
    if len(keys) % num_stages:
        raise ValueError(
            f"{len(keys)} blocks do not split evenly into {num_stages} pipeline stages: "
            f"{len(keys)} / {num_stages} = {len(keys) / num_stages:.3g}"
        )
    first, last = stage_idx == 0, stage_idx == num_stages - 1
    sizes = gpt_stage_layers(model.config, num_stages) if len(keys) == model.config.n_layer else None
    if sizes is None:  # a model already pruned to other blocks: split what it has evenly
        sizes = [len(keys) // num_stages] * num_stages
    start = sum(sizes[:stage_idx])
    kept = keys[start : start + sizes[stage_idx]]

    cls = type(model)
    stage = cls.__new__(cls)
    nn.Module.__init__(stage)
    stage.config = model.config
    stage.init_from_hf = model.init_from_hf
    stage.tok_emb = model.tok_emb if first else None
    stage.pos_emb = model.pos_emb if first else None
    stage.blocks = nn.ModuleDict({k: model.blocks[k] for k in kept})
    stage.norm = model.norm if last else None
    # a tied head on a later stage than the embedding: the embedding module, whose (V, d) weight the head uses
    tied = model.lm_head is None and not first
    stage.lm_head = (model.tok_emb if tied else model.lm_head) if last else None
    # the last stage's loss applies the head (GPT.pipeline_loss), so its logits never leave the loss
    stage.head_in_loss = last
    stage.register_buffer("rope_cos", model.rope_cos, persistent=False)
    stage.register_buffer("rope_sin", model.rope_sin, persistent=False)
    return stage
