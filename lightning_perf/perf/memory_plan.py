"""Predicted peak GPU memory of a training step, per rank, by part, from numbers alone.

The model is a decoder-only transformer described by :class:`ModelShape` (the pack's GPT presets, or any
model with the same block: norm -> q/k/v -> attention -> o -> residual -> norm -> MLP -> residual). The
layout (:class:`MemoryLayout`: data / tensor / pipeline / context parallel sizes, the ZeRO stage and its
engine, FSDP units and prefetch, FP8 all-gathers, CPU offload, the pipeline schedule) and the step
(:class:`StepShape`: micro-batch, sequence length, accumulation, activation checkpointing, compile,
precision) complete the picture. :func:`estimate_peak` returns a :class:`MemoryEstimate`.

How the peak is found. A training step's allocated memory is

    state (parameters, gradients, optimizer state, as each rank holds them)
    + gathered parameters (FSDP units all-gathered, their FP8 copies)
    + saved activations (what the forward keeps for the backward)
    + transients (logits and the loss's buffers, one layer's backward temporaries and recomputation,
      unsharded gradients of the unit being reduced, workspaces)

and it peaks at one of three moments: the start of the backward (every activation saved, the loss's
gradient made, no gradient of this micro-batch yet), the end of the backward (every gradient made, the
activations freed) or the optimizer step. Between the first two the backward trades each layer's saved
activations for its gradients, so the running total is largest at one of the ends; the estimate is the
largest of the three, each with the transients live at that moment.

The activation bytes per token of one block come from counting the tensors the block saves (per
checkpointing mode, FP8 recipe, kernels and compile) as :func:`block_activation_bytes` lists them,
scaled by factors measured on a GPU (:data:`CALIBRATION`, ``benchmarks/bench_memory_plan.py``) where the
counted figure and the measured one differ (compiled graphs recompute some elementwise results instead of
saving them; attention backends differ in what they save).

What it leaves out (the reasons an estimate may read low):
- fragmentation: the allocator's reserved memory above the allocated peak (the planner keeps headroom for it
  instead; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` shrinks it);
- memory outside PyTorch's allocator: the CUDA context, NCCL's buffers, cuDNN / cuBLAS handles;
- CUDA-graph pools (``compile="reduce-overhead"``): their memory is reserved, not allocated per step;
- the first step's one-off buffers (autotuning, compile), and a checkpoint's staging copies;
- evaluation: a validation step keeps no activations and runs at the training micro-batch, so it stays below
  the training peak;
- models other than the transformer block above (their state is counted exactly, their activations are not).

Sizes are bytes; :attr:`MemoryEstimate.peak_gb` and friends are GB (10^9 bytes), as the pack's reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

__all__ = [
    "ModelShape",
    "MemoryLayout",
    "StepShape",
    "MemoryEstimate",
    "RankMemory",
    "CALIBRATION",
    "ACCUMULATION_MODES",
    "block_activation_bytes",
    "estimate_peak",
]

GB = 1e9
ACCUMULATION_MODES = ("reduce_each", "reduce_once", "gather_once")
_AC_MODES = ("none", "selective", "full")

#: what the CUDA libraries and the pack take from the allocator beside the model (cuBLAS / cuBLASLt workspaces,
#: the attention selector's probes, the loss's pinned copies): a constant per rank
WORKSPACE_BYTES = 0.35 * GB


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on (see :meth:`from_config`)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    intermediate_size: int
    vocab_size: int  # padded: the embedding's and head's rows
    block_size: int = 2048
    activation: Literal["gelu", "swiglu"] = "swiglu"
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    learned_positions: bool = False
    tie_embeddings: bool = False
    bias: bool = False
    qkv_bias: bool = False
    fp8: str = "none"  # "none", "tensorwise", "rowwise", "delayed"
    fused_qkv: bool = False
    kernels: Literal["torch", "triton"] = "torch"

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a :class:`~lightning_perf.models.GPTConfig` (or anything with its field names)."""
        fp8 = getattr(config, "fp8", None) or "none"
        if fp8 is True:
            fp8 = "tensorwise"
        qkv_bias = getattr(config, "qkv_bias", None)
        return cls(
            n_layer=int(config.n_layer), n_embd=int(config.n_embd), n_head=int(config.n_head),
            n_kv_head=int(getattr(config, "n_kv_head", None) or config.n_head),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(getattr(config, "padded_vocab_size", config.vocab_size)),
            block_size=int(getattr(config, "block_size", 2048)),
            activation=getattr(config, "activation", "gelu"), norm=getattr(config, "norm", "layernorm"),
            learned_positions=getattr(config, "positions", "learned") == "learned",
            tie_embeddings=bool(getattr(config, "tie_embeddings", True)), bias=bool(getattr(config, "bias", True)),
            qkv_bias=bool(config.bias if qkv_bias is None else qkv_bias), fp8=str(fp8),
            fused_qkv=bool(getattr(config, "fused_qkv", False)), kernels=getattr(config, "kernels", "torch"),
        )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    def linear_params_per_block(self) -> int:
        """Weights and biases of a block's linears (what tensor parallelism splits and FP8 casts)."""
        d, kv, f = self.n_embd, self.kv_width, self.intermediate_size
        mlp_in = 2 if self.activation == "swiglu" else 1
        weights = d * d + 2 * d * kv + d * d + (mlp_in + 1) * d * f
        biases = (d + 2 * kv) * self.qkv_bias + (d + mlp_in * f + d) * self.bias
        return weights + biases

    def norm_params(self) -> int:
        return self.n_embd * (2 if self.norm == "layernorm" and self.bias else 1)

    def params_per_block(self) -> int:
        return self.linear_params_per_block() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token embedding (and learned positions)."""
        return self.vocab_size * self.n_embd + (self.block_size * self.n_embd if self.learned_positions else 0)

    def head_params(self) -> int:
        """The LM head's own weight (0 when tied to the embedding) and the final norm."""
        return (0 if self.tie_embeddings else self.vocab_size * self.n_embd) + self.norm_params()

    def num_params(self) -> int:
        return self.n_layer * self.params_per_block() + self.embedding_params() + self.head_params()


@dataclass(kw_only=True, frozen=True)
class MemoryLayout:
    """How the model and its state are split over the ranks (sizes multiply to the world size).

    ``engine``: ``"none"`` (one device, or plain replicas), ``"ddp"`` (stage 0/1: DDP, ZeRO-1 through a
    sharded optimizer), ``"fsdp"`` (stage 2/3 through FSDP2) or ``"deepspeed"``. ``accumulation`` says what
    the ranks keep between the micro-batches of one optimizer step (:data:`ACCUMULATION_MODES`).
    """

    data_parallel_size: int = 1
    replicate_size: int = 1  # HSDP: state sharded over data_parallel_size / replicate_size ranks
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    zero_stage: int = 0
    engine: Literal["none", "ddp", "fsdp", "deepspeed"] = "none"
    reshard_after_forward: Optional[bool] = None  # None: stage == 3
    blocks_per_unit: int = 1
    prefetch: int = 1
    fp8_all_gather: bool = False
    offload: bool = False  # optimizer state, master weights and their gradients in host memory
    sequence_parallel: bool = True
    pipeline_schedule: str = "1f1b"
    num_microbatches: int = 1
    stages_per_rank: int = 1
    accumulation: str = "reduce_once"

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
                     "context_parallel_size", "blocks_per_unit", "num_microbatches", "stages_per_rank",
                     "replicate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {self.zero_stage!r}")
        if self.accumulation not in ACCUMULATION_MODES:
            raise ValueError(f"accumulation must be one of {ACCUMULATION_MODES}, got {self.accumulation!r}")

    @property
    def world_size(self) -> int:
        return (self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size
                * self.context_parallel_size)

    @property
    def shard_size(self) -> int:
        """Ranks that share (shard) one copy of the model state under ZeRO: dp x cp (over the HSDP replicas)."""
        return max(1, self.data_parallel_size * self.context_parallel_size // self.replicate_size)

    @property
    def resharded(self) -> bool:
        """Whether gathered parameters are freed after each unit's forward (ZeRO-3)."""
        if self.engine != "fsdp":
            return False
        return self.zero_stage == 3 if self.reshard_after_forward is None else bool(self.reshard_after_forward)


@dataclass(kw_only=True, frozen=True)
class StepShape:
    """One optimizer step: ``accumulate_grad_batches`` micro-batches of ``micro_batch`` sequences per rank."""

    micro_batch: int
    seq_len: int
    accumulate_grad_batches: int = 1
    activation_checkpointing: str = "none"
    compile: bool = False
    compile_scope: str = "block"  # "model": the head and the loss compiled with the blocks
    precision: str = "bf16-mixed"
    reduce_bytes: int = 4  # FSDP2's gradient reduction dtype (fp32 by default)

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "accumulate_grad_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.activation_checkpointing not in _AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {_AC_MODES}, got "
                             f"{self.activation_checkpointing!r}")

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of the weights the optimizer updates (fp32, or the half type under *-true)."""
        return 2 if self.precision in ("bf16-true", "16-true") else 4

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and gathered weights (bf16 / fp16 under the half precisions)."""
        return 4 if self.precision == "32-true" else 2


# ---- activations of one block -------------------------------------------------------------------------

def block_activation_bytes(model: ModelShape, mode: str, *, residual_bytes: int, fp8: bool = False,
                           compiled: bool = False, autocast: bool = False) -> dict[str, float]:
    """Bytes a block saves for its backward, per token, by tensor, before calibration.

    ``residual_bytes``: 4 where the residual stream is fp32 (fp32 weights under autocast), 2 where FSDP2's
    bf16 weights make it bf16. ``autocast``: uncompiled linears under autocast each cast their (fp32) input
    to bf16 and keep that copy, so separate q, k and v projections keep three. Per checkpointing mode:

    - ``"none"``: the two norms' inputs (residual dtype); each matmul's input for its weight gradient (the
      norms' outputs, the attention output laid out for ``o_proj``, the MLP activation's output: bf16, or their
      FP8 copies under FP8 linears); q, k, v after RoPE, the attention output and its log-sum-exp; the MLP
      projections (SwiGLU: gate and up, and silu(gate) where PyTorch's ops run it uncompiled; GELU: its input).
    - ``"selective"``: the block input, the outputs of the matmuls and the attention (q/k/v, attention output
      and log-sum-exp, the MLP projections, one of the two residual branches' outputs); the rest recomputed.
    - ``"full"``: the block input alone.
    """
    d, kv, f, h = model.n_embd, model.kv_width, model.intermediate_size, model.n_head
    r, a = residual_bytes, 2
    lse = 4 * h
    mlp_in = 2 * f if model.activation == "swiglu" else f
    if mode == "full":
        return {"block input": r * d}
    if mode == "selective":
        return {"block input": r * d, "q, k, v": a * (d + 2 * kv), "attention output": a * d + lse,
                "branch output": a * d, "mlp projections": a * mlp_in}
    mm_in = 1 if fp8 else a  # a matmul's saved input (FP8 linears keep the FP8 copy)
    copies = 2
    if autocast and not compiled and not fp8:
        copies = (1 if model.fused_qkv else 3) + (2 if model.activation == "swiglu" else 1)
    parts: dict[str, float] = {
        "norm inputs": 2 * r * d,
        "norm outputs (q/k/v and MLP inputs)": copies * mm_in * d,
        "q, k, v": a * (d + 2 * kv),
        "attention output": a * d + lse,
        "o_proj input": mm_in * d,
        "mlp projections": a * mlp_in,
        "down input": mm_in * f,
    }
    if model.activation == "swiglu" and not compiled and model.kernels == "torch":
        parts["silu(gate)"] = a * f
    return parts


#: measured / counted saved activations of one block, by (mode, compiled, fp8, kernels): the measurements of
#: ``benchmarks/bench_memory_plan.py --part layers`` (llama-8b and gpt-1.3b blocks at T=8192 / 2048 on an H100)
#: over :func:`block_activation_bytes` for the same shapes; 1.0 where the count is the measurement
CALIBRATION: dict[tuple[str, bool, str, str], float] = {
    # FP8 through torchao's matmul (weights all-gathered in FP8, or tensor-parallel): measured on 4 GPUs
    ("none", True, "torchao", "triton"): 0.81,
    ("none", True, "pack", "triton"): 0.99,
    ("selective", True, "pack", "triton"): 0.998,
    ("selective", True, "torchao", "triton"): 0.998,
    ("selective", True, "none", "triton"): 0.998,
    ("none", True, "none", "triton"): 1.002,
    ("none", False, "pack", "triton"): 1.155,
    ("none", False, "none", "torch"): 1.0,
    ("full", True, "pack", "triton"): 1.03,
    ("full", True, "torchao", "triton"): 1.03,
}


def _calibrated(model: ModelShape, mode: str, *, residual_bytes: int, fp8_path: str, compiled: bool,
                autocast: bool = False) -> float:
    """One block's saved bytes per token; ``fp8_path``: "none", "pack" (the pack's FP8 matmul on plain weights,
    which keeps FP8 copies) or "torchao" (torchao's matmul, for weights gathered in FP8 or tensor-parallel)."""
    parts = block_activation_bytes(model, mode, residual_bytes=residual_bytes, fp8=fp8_path != "none",
                                   compiled=compiled, autocast=autocast)
    key = (mode, compiled, fp8_path, model.kernels)
    return sum(parts.values()) * CALIBRATION.get(key, 1.0)


# ---- the estimate -------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class RankMemory:
    """One rank's predicted memory: its parts (bytes) at the peak, and which moment the peak is."""

    rank: int
    parts: dict[str, float]
    moment: str

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(kw_only=True)
class MemoryEstimate:
    """Predicted peak allocated memory per GPU (see the module docstring for what it leaves out)."""

    ranks: list[RankMemory]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_rank(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def peak_bytes(self) -> float:
        return self.peak_rank.total

    @property
    def peak_gb(self) -> float:
        """The largest rank's peak, GB."""
        return self.peak_bytes / GB

    @property
    def per_rank_gb(self) -> list[float]:
        """Each rank's peak, GB, in rank order."""
        return [r.total / GB for r in sorted(self.ranks, key=lambda r: r.rank)]

    @property
    def parts_gb(self) -> dict[str, float]:
        """The largest rank's parts, GB."""
        return {k: v / GB for k, v in self.peak_rank.parts.items()}

    def as_dict(self) -> dict[str, Any]:
        return {"peak_gb": self.peak_gb, "per_rank_gb": self.per_rank_gb, "parts_gb": self.parts_gb,
                "peak_rank": self.peak_rank.rank, "moment": self.peak_rank.moment, "notes": list(self.notes)}


def _stage_blocks(model: ModelShape, layout: MemoryLayout, stage_blocks: Optional[list[int]]) -> list[list[int]]:
    """Blocks of each pipeline rank's stages: ``[[blocks of stage r, r + pp, ...] for r in ranks]``."""
    pp, s = layout.pipeline_parallel_size, layout.stages_per_rank
    n = pp * s
    if stage_blocks is None:
        base, extra = divmod(model.n_layer, n)
        stage_blocks = [base + (1 if i < extra else 0) for i in range(n)]
    if len(stage_blocks) != n or sum(stage_blocks) != model.n_layer:
        raise ValueError(f"stage_blocks {stage_blocks} must give {n} stages covering {model.n_layer} blocks")
    return [[stage_blocks[r + k * pp] for k in range(s)] for r in range(pp)]


def _in_flight(layout: MemoryLayout, pp_rank: int, stage_index: int) -> int:
    """Micro-batches whose activations one stage of a pipeline rank holds at its fullest."""
    pp, m, s = layout.pipeline_parallel_size, layout.num_microbatches, layout.stages_per_rank
    if pp == 1:
        return 1
    if layout.pipeline_schedule in ("gpipe", "looped_bfs"):
        return m
    if s == 1:  # 1F1B: the warm-up fills pp - rank micro-batches
        return min(m, pp - pp_rank)
    # interleaved: the warm-up runs (pp - rank - 1) * 2 + (s - 1) * pp forwards across the rank's stages
    warmup = min(m * s, (pp - pp_rank - 1) * 2 + (s - 1) * pp + 1)
    per_stage = -(-warmup // s)
    return min(m, per_stage + (1 if stage_index == 0 else 0))


#: share of one layer's activations that its backward holds as temporaries (gradients of its activations),
#: calibrated on the measured peaks
LAYER_BACKWARD_SHARE = 0.5


def estimate_peak(model: ModelShape, layout: MemoryLayout, step: StepShape, *,
                  stage_blocks: Optional[list[int]] = None) -> MemoryEstimate:
    """Predicted peak allocated memory of every rank (one entry per pipeline rank: the ranks of one pipeline
    stage across data, context and tensor parallelism hold alike).

    ``stage_blocks``: blocks per pipeline stage, in stage order (default: as even as possible).
    """
    tp, pp, cp = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.context_parallel_size
    shard = layout.shard_size
    mb, cb = step.master_bytes, step.compute_bytes
    mixed = step.precision.endswith("-mixed")
    fsdp = layout.engine == "fsdp"
    # under FSDP2's policy (or DeepSpeed's casts) the block's weights, and so its activations, are bf16
    residual = cb if (fsdp or layout.engine == "deepspeed" or not mixed) else 4
    fp8 = model.fp8 != "none"
    fp8_gathered = fp8 and fsdp and layout.fp8_all_gather
    mode = step.activation_checkpointing
    tokens = step.micro_batch * step.seq_len // cp  # one micro-batch on this rank
    act_tokens = tokens  # the tensor-parallel split is in the per-block bytes below
    autocast = mixed and residual == 4
    fp8_path = "none" if not fp8 else ("torchao" if (fp8_gathered or tp > 1) else "pack")
    per_block = _calibrated(model, mode, residual_bytes=residual, fp8_path=fp8_path, compiled=step.compile,
                            autocast=autocast)
    per_block_none = _calibrated(model, "none", residual_bytes=residual, fp8_path=fp8_path, compiled=step.compile,
                                 autocast=autocast)
    if tp > 1:
        # every saved tensor is split over the tp ranks (by heads / hidden width, and the residual stream by
        # sequence or batch under sequence parallelism), except the column-parallel linears' inputs: the
        # all-gathered norm outputs, which each rank keeps whole for its weight gradient
        gathered_inputs = block_activation_bytes(model, mode, residual_bytes=residual, fp8=fp8, compiled=step.compile,
                                                 autocast=autocast).get("norm outputs (q/k/v and MLP inputs)", 0.0)
        gathered_none = block_activation_bytes(model, "none", residual_bytes=residual, fp8=fp8,
                                               compiled=step.compile,
                                               autocast=autocast)["norm outputs (q/k/v and MLP inputs)"]
        split = 1 / tp if layout.sequence_parallel else (1 + 1 / tp) / 2
        per_block = per_block * split + gathered_inputs * (1 - 1 / tp)
        per_block_none = per_block_none * split + gathered_none * (1 - 1 / tp)
    linear_local = model.linear_params_per_block() / tp
    block_local = linear_local + 2 * model.norm_params()
    gathered_block = linear_local * (1 if fp8_gathered else cb) + 2 * model.norm_params() * cb
    accumulating = step.accumulate_grad_batches > 1
    d, V = model.n_embd, model.vocab_size / tp

    ranks: list[RankMemory] = []
    for pp_rank, blocks in enumerate(_stage_blocks(model, layout, stage_blocks)):
        first, last = pp_rank == 0, pp_rank == pp - 1
        n_blocks = sum(blocks)
        emb = model.embedding_params() / tp if first else 0.0
        head = 0.0
        if last:
            head = (model.head_params() - model.norm_params()) / tp + model.norm_params()
            if model.tie_embeddings and not first:
                head += model.vocab_size * d / tp  # the tied weight's copy on the last stage
        root = emb + head  # FSDP2's root unit: everything outside the blocks
        own = n_blocks * block_local + root
        shard_params = layout.zero_stage >= 3 or (fsdp and layout.zero_stage >= 2)
        params_local = own / shard if shard_params else own
        grads_local = own / shard if layout.zero_stage >= 2 else own
        opt_local = own / shard if layout.zero_stage >= 1 else own
        if layout.offload:
            params_local = grads_local = opt_local = 0.0

        state = {"parameters": params_local * mb, "optimizer state": 2 * opt_local * mb,
                 "workspace": WORKSPACE_BYTES}
        if layout.engine == "ddp":  # DDP's gradient buckets: a second copy of the gradients, allocated once
            state["gradient buckets"] = own * mb
        # gathered parameters live from the forward into the backward (bf16; FP8 linears gathered in FP8)
        if fsdp:
            unit_blocks = min(n_blocks, layout.blocks_per_unit)
            unit = unit_blocks * gathered_block
            if layout.resharded and not (accumulating and layout.accumulation == "gather_once"):
                units_live = 2 + layout.prefetch  # the last unit (kept for the backward), the current, prefetched
                gathered = root * cb + min(n_blocks * gathered_block, units_live * unit)
            else:  # ZeRO-2, or kept gathered across the micro-batches of a step
                gathered = root * cb + n_blocks * gathered_block
        else:
            unit_blocks, unit = 0, 0.0
            gathered = 0.0
            if fp8:  # FP8 linears cast their weights per forward, kept for the backward
                gathered = n_blocks * linear_local
            elif autocast:  # autocast's bf16 copies of the fp32 weights, kept for the backward
                gathered = n_blocks * linear_local * 2
        # gradients held through the forward: when accumulating, and in a pipeline, whose backward of one
        # micro-batch runs while the next ones go forward
        if pp > 1:
            held_grads = grads_local * mb if not fsdp else own * step.reduce_bytes
        elif not accumulating:
            held_grads = 0.0
        elif fsdp and layout.accumulation != "reduce_each":
            held_grads = own * step.reduce_bytes  # unsharded, in the reduction dtype
        else:
            held_grads = grads_local * mb
        # saved activations: each stage's blocks times the micro-batches in flight there
        acts = sum(nb * per_block * act_tokens * _in_flight(layout, pp_rank, k) for k, nb in enumerate(blocks))
        # the loss (last stage): what its forward keeps, and the head's gradient at the start of the backward
        loss_saved = loss_fwd_transient = loss_bwd_transient = head_grad = 0.0
        if last:
            if model.kernels == "triton":  # fused linear cross-entropy: dW and dx made in the forward
                loss_saved = V * d * cb + tokens * d * cb
                loss_fwd_transient = min(tokens, max(1, int(256 * 2**20 / (V * cb)))) * V * 4
            elif step.compile and step.compile_scope == "model" and tp == 1:  # one graph: the bf16 logits kept
                loss_saved = tokens * V * 2
            else:
                loss_saved = tokens * V * 4  # the log-softmax output, fp32
                loss_fwd_transient = tokens * V * (2 + 4)
                loss_bwd_transient = tokens * V * (4 + 2)
            loss_saved += tokens * d * residual  # the final norm's input
            if fsdp or model.kernels != "triton":
                head_grad = V * d * (cb if fsdp else mb)  # the head's gradient, unsharded until the root reduces
        # one layer's backward: its recomputation, the gradients of its activations, its unit's gradients
        if mode == "full":
            recompute = per_block_none * act_tokens
        elif mode == "selective":
            recompute = max(0.0, per_block_none - per_block) * act_tokens
        else:
            recompute = 0.0
        layer_bwd = recompute + LAYER_BACKWARD_SHARE * per_block_none * act_tokens
        if fsdp:  # the unit's unsharded gradients and their reduction copy, and the next unit prefetched
            layer_bwd += unit_blocks * block_local * (cb + step.reduce_bytes) + unit * min(layout.prefetch, 1)
        # the three moments
        moments: dict[str, dict[str, float]] = {}
        moments["start of backward"] = {
            **state, "gathered parameters": gathered, "gradients": held_grads + head_grad, "activations": acts,
            "logits and loss": loss_saved + loss_bwd_transient, "backward temporaries": layer_bwd}
        moments["end of forward"] = {
            **state, "gathered parameters": gathered, "gradients": held_grads, "activations": acts,
            "logits and loss": loss_saved + loss_fwd_transient, "backward temporaries": 0.0}
        grads_end = max(grads_local * mb, held_grads)
        reduce_buffer = root * step.reduce_bytes if fsdp else 0.0  # the root's gradients, reduced last
        moments["end of backward"] = {
            **state, "gathered parameters": 0.0, "gradients": grads_end + reduce_buffer, "activations": 0.0,
            "logits and loss": 0.0, "backward temporaries": 0.0}
        moment = max(moments, key=lambda k: sum(moments[k].values()))
        ranks.append(RankMemory(rank=pp_rank, parts=moments[moment], moment=moment))
    return MemoryEstimate(ranks=ranks)

