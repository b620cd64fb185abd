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

from dataclasses import dataclass, field, replace
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
                           compiled: bool = False) -> dict[str, float]:
    """Bytes a block saves for its backward, per token, by tensor, before calibration.

    ``residual_bytes``: 4 where the residual stream is fp32 (fp32 weights under autocast), 2 where FSDP2's
    bf16 weights make it bf16. Per checkpointing mode:

    - ``"none"``: the two norms' inputs (residual dtype) and outputs (bf16, the next matmul's input); q, k, v
      after RoPE, the attention output and its log-sum-exp; the attention output laid out for ``o_proj``;
      the MLP's inputs to its activation and the activation's output (SwiGLU: gate, up and silu(gate), GELU:
      its input), then the down projection's input. FP8 linears keep their inputs' FP8 copies (1 byte) in
      place of the bf16 ones a matmul's weight gradient reads; a compiled block recomputes the norms and the
      activation function's elementwise outputs from their inputs instead of keeping them.
    - ``"selective"``: the block input, every matmul's and the attention's outputs (q/k/v, attention output and
      log-sum-exp, o_proj, MLP in, down); the rest recomputed.
    - ``"full"``: the block input alone.
    """
    d, kv, f, h = model.n_embd, model.kv_width, model.intermediate_size, model.n_head
    r, a = residual_bytes, 2
    lse = 4 * h
    if mode == "full":
        return {"block input": r * d}
    if mode == "selective":
        mlp_in = 2 * f if model.activation == "swiglu" else f
        return {"block input": r * d, "q, k, v": a * (d + 2 * kv), "attention output": a * d + lse,
                "o_proj output": a * d, "mlp projections": a * mlp_in, "down output": a * d}
    mm_in = 1 if fp8 else a  # a matmul's saved input (FP8 linears keep the FP8 copy)
    parts: dict[str, float] = {}
    parts["norm inputs"] = 2 * r * d
    parts["matmul inputs (norm outputs)"] = 2 * mm_in * d if not (model.fused_qkv and False) else 0
    parts["q, k, v"] = a * (d + 2 * kv)
    parts["attention output"] = a * d + lse
    parts["o_proj input"] = mm_in * d
    if model.activation == "swiglu":
        parts["mlp gate, up"] = a * 2 * f
        parts["silu(gate)"] = 0 if compiled or model.kernels == "triton" else a * f
    else:
        parts["mlp up"] = a * f
    parts["down input"] = mm_in * f
    if compiled:  # norms recomputed from their inputs in the backward
        parts["matmul inputs (norm outputs)"] = 2 * mm_in * d if fp8 else 0
    return parts


#: measured / counted activation bytes, by (mode, compiled, fp8): ``benchmarks/bench_memory_plan.py --part
#: layers`` measures a block's saved bytes on a GPU; the factors below are those measurements over
#: :func:`block_activation_bytes` for the same shape (1.0 where nothing was measured)
CALIBRATION: dict[tuple[str, bool, bool], float] = {}


def _calibrated(model: ModelShape, mode: str, *, residual_bytes: int, fp8: bool, compiled: bool) -> float:
    parts = block_activation_bytes(model, mode, residual_bytes=residual_bytes, fp8=fp8, compiled=compiled)
    return sum(parts.values()) * CALIBRATION.get((mode, compiled, fp8), 1.0)


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

    def fits(self, capacity_bytes: float, *, headroom: float = 0.08) -> bool:
        """Whether the peak stays under ``capacity_bytes`` less ``headroom`` (a share kept for fragmentation)."""
        return self.peak_bytes <= capacity_bytes * (1.0 - headroom)

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
    # interleaved: the warm-up runs (pp - rank - 1) * 2 + (s - 1) * pp forwards across the rank's stages,
    # spread over its s stages; the earlier (virtual) stage holds the larger share
    warmup = min(m * s, (pp - pp_rank - 1) * 2 + (s - 1) * pp + 1)
    per_stage = -(-warmup // s)
    return min(m, per_stage + (1 if stage_index == 0 else 0))


def estimate_peak(model: ModelShape, layout: MemoryLayout, step: StepShape, *,
                  stage_blocks: Optional[list[int]] = None) -> MemoryEstimate:
    """Predicted peak allocated memory of every rank (one per pipeline rank: the others repeat it).

    ``stage_blocks``: blocks per pipeline stage, in stage order (default: as even as possible); the pack's
    GPT balances the head (``GPT.pipeline_stage``'s split), which the caller passes.
    """
    tp, pp, cp = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.context_parallel_size
    shard = layout.shard_size
    mb = step.master_bytes
    cb = step.compute_bytes
    mixed = step.precision.endswith("-mixed")
    fsdp = layout.engine == "fsdp"
    deepspeed = layout.engine == "deepspeed"
    # under FSDP2's policy (or DeepSpeed's casts) the block's weights, and so its activations, are bf16
    residual = cb if (fsdp or deepspeed or not mixed) else 4
    fp8 = model.fp8 != "none"
    notes: list[str] = []
    if tp > 1 and fp8 and layout.fp8_all_gather:
        notes.append("tensor-parallel FP8 linears gather per rank: FP8 all-gathers count only data-parallel units")

    tokens = step.micro_batch * step.seq_len // cp  # per micro-batch on this rank
    act_tokens = tokens // tp if (tp > 1 and layout.sequence_parallel) else tokens
    mode = step.activation_checkpointing
    per_block_act = _calibrated(model, mode, residual_bytes=residual, fp8=fp8, compiled=step.compile)
    if tp > 1:  # every saved tensor but the block input and the norm inputs is split over the tp ranks
        per_block_act = per_block_act / tp if layout.sequence_parallel else per_block_act * (1 + 1 / tp) / 2
    none_act = _calibrated(model, "none", residual_bytes=residual, fp8=fp8, compiled=step.compile) / (
        tp if tp > 1 else 1)

    ranks: list[RankMemory] = []
    for pp_rank, blocks in enumerate(_stage_blocks(model, layout, stage_blocks)):
        first, last = pp_rank == 0, pp_rank == pp - 1
        n_blocks = sum(blocks)
        # parameters this rank owns before ZeRO: blocks split over tp, embedding and head vocab-parallel
        block_params = n_blocks * (model.linear_params_per_block() / tp + 2 * model.norm_params())
        emb = model.embedding_params() / tp if first else 0
        head = 0.0
        if last:
            head = (model.head_params() - model.norm_params()) / tp + model.norm_params()
            if model.tie_embeddings and not first:
                head += model.vocab_size * model.n_embd / tp  # the tied weight's copy on the last stage
        own = block_params + emb + head
        sharded_state = layout.zero_stage >= 1 and shard > 1
        params_shard = own / shard if (layout.zero_stage >= 2 or (fsdp and layout.zero_stage >= 2)) else own
        grads_shard = own / shard if layout.zero_stage >= 2 else own
        opt = own / shard if sharded_state else own

        parts: dict[str, float] = {}
        if layout.offload:
            parts["parameters (device copies)"] = 0.0
        else:
            parts["parameters"] = params_shard * mb
        opt_bytes = 0.0 if layout.offload else 2 * opt * mb  # AdamW: exp_avg and exp_avg_sq
        parts["optimizer state"] = opt_bytes

        # gathered parameters: FSDP2 units in flight (compute dtype; FP8 linears gathered in FP8)
        unit_blocks = layout.blocks_per_unit
        per_block_gathered = model.linear_params_per_block() / tp * (1 if (fp8 and layout.fp8_all_gather) else cb) \
            + 2 * model.norm_params() * cb
        gathered_fwd = 0.0
        if fsdp:
            root = (emb + head) * cb
            if layout.resharded:
                units_live = min(n_blocks, unit_blocks * (1 + layout.prefetch))
                gathered_fwd = root + units_live * per_block_gathered + unit_blocks * per_block_gathered  # last kept
            else:  # ZeRO-2: gathered from the forward to the backward
                gathered_fwd = root + n_blocks * per_block_gathered
        elif mixed and not deepspeed:
            # autocast keeps no weight copies across ops; FP8 linears cast their weights per matmul
            gathered_fwd = 0.0
        if fp8 and not (fsdp and layout.fp8_all_gather):
            # FP8 linears' weight casts (and transposes) live from the forward of a layer to its backward
            gathered_fwd += 2 * min(n_blocks, 2) * model.linear_params_per_block() / tp
        # accumulation: what persists between micro-batches
        accum = step.accumulate_grad_batches > 1
        grads_live_fwd = 0.0
        if accum:
            if layout.engine in ("none", "ddp") or layout.accumulation in ("reduce_once", "gather_once"):
                unsharded = own if layout.engine != "none" or layout.zero_stage < 2 else own
                grads_live_fwd = unsharded * (step.reduce_bytes if fsdp else mb)
            else:
                grads_live_fwd = grads_shard * mb
            if fsdp and layout.accumulation == "gather_once":
                gathered_fwd = (emb + head) * cb + n_blocks * per_block_gathered
        # activations: each stage's blocks times the micro-batches in flight there
        acts = 0.0
        for k, nb in enumerate(blocks):
            acts += nb * per_block_act * act_tokens * _in_flight(layout, pp_rank, k)
        if first:  # embedding output (the first block's input is saved by the block itself)
            acts += 0.0
        loss_fwd, loss_bwd = 0.0, 0.0
        if last:
            v = model.vocab_size / tp
            n_tok = tokens  # the head sees whole sequences
            if model.kernels == "triton":
                chunk = min(n_tok, 4096)  # the chunked loss: one chunk of fp32 logits and its gradient
                loss_fwd = chunk * v * 8 + n_tok * model.n_embd * 4
                loss_bwd = loss_fwd
            elif step.compile:
                loss_fwd = n_tok * v * 4
                loss_bwd = n_tok * v * 6
            else:
                loss_fwd = n_tok * v * 4  # log-softmax output kept for the backward
                loss_bwd = n_tok * v * (4 + 4 + 2)  # + its gradient, + the bf16 logits' gradient
            loss_fwd += n_tok * model.n_embd * residual  # the final norm's input
        # one layer's backward: recomputation and gradients of its activations
        layer_tokens = act_tokens
        if mode == "full":
            recompute = none_act * layer_tokens
        elif mode == "selective":
            recompute = max(0.0, none_act - per_block_act) * layer_tokens
        else:
            recompute = 0.0
        grad_temps = (2 * model.n_embd * 4 + 3 * model.intermediate_size / tp * 2) * layer_tokens
        unit_params = unit_blocks * model.params_per_block() / tp
        unit_grad = unit_params * (cb + (step.reduce_bytes if fsdp else 0)) if fsdp else 0.0
        prefetch_bwd = per_block_gathered * unit_blocks * layout.prefetch if layout.resharded else 0.0
        layer_bwd = recompute + grad_temps + unit_grad + prefetch_bwd

        ws = WORKSPACE_BYTES
        base = parts["parameters"] if "parameters" in parts else 0.0
        base += opt_bytes + ws
        # the three moments
        start_bwd = base + gathered_fwd + grads_live_fwd + acts + loss_fwd + loss_bwd
        all_grads = grads_shard * (mb if not fsdp else mb) if not layout.offload else 0.0
        if not fsdp and not layout.offload:
            all_grads = own * mb  # DDP / one device: every gradient whole
        end_bwd = base + gathered_fwd + max(all_grads, grads_live_fwd) + layer_bwd
        if layout.engine == "ddp" and shard > 1:
            end_bwd += 0.0  # gradients are DDP's bucket views: no second copy
        step_moment = base + max(all_grads, grads_live_fwd)
        moments = {"start of backward": start_bwd + layer_bwd, "end of backward": end_bwd,
                   "optimizer step": step_moment}
        moment = max(moments, key=moments.get)  # type: ignore[arg-type]
        out = dict(parts)
        out["workspace"] = ws
        if moment == "start of backward":
            out.update({"gathered parameters": gathered_fwd, "gradients": grads_live_fwd, "activations": acts,
                        "logits and loss": loss_fwd + loss_bwd, "backward temporaries": layer_bwd})
        elif moment == "end of backward":
            out.update({"gathered parameters": gathered_fwd, "gradients": max(all_grads, grads_live_fwd),
                        "activations": 0.0, "logits and loss": 0.0, "backward temporaries": layer_bwd})
        else:
            out.update({"gathered parameters": 0.0, "gradients": max(all_grads, grads_live_fwd),
                        "activations": 0.0, "logits and loss": 0.0, "backward temporaries": 0.0})
        ranks.append(RankMemory(rank=pp_rank, parts=out, moment=moment))
    return MemoryEstimate(ranks=ranks, notes=notes)


def with_step(step: StepShape, **changes: Any) -> StepShape:
    """``step`` with ``changes`` (a convenience for searching over micro-batches and modes)."""
    return replace(step, **changes)
