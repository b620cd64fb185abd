"""GPT configuration: one dataclass, presets by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_perf.kernels.torchao_fp8 import normalize_fp8

__all__ = ["GPTConfig", "PRESETS"]

_NORMS = ("layernorm", "rmsnorm")
_ACTIVATIONS = ("gelu", "swiglu")
_POSITIONS = ("learned", "rope")
_KERNELS = ("torch", "triton")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ATTENTION = ("auto", "triton", "sdpa", "flex", "fa3", "fa4")  # kernels.dispatch.ATTENTION_IMPLS


def _pad(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass(kw_only=True)
class GPTConfig:
    """Shape and options of a decoder-only transformer.

    ``vocab_size`` is the tokenizer's vocabulary; the embedding and head use
    ``padded_vocab_size`` (rounded up to ``pad_vocab_multiple``, 64 by default) so
    the head matmul has tensor-core friendly shapes (GPT-2's 50257 -> 50304).
    """

    name: str = "custom"
    block_size: int = 1024  # longest sequence the model accepts (learned positions / RoPE table)
    vocab_size: int = 50257
    pad_vocab_multiple: int = 64
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None  # None = n_head (multi-head); fewer = grouped-query attention
    n_embd: int = 768
    intermediate_size: Optional[int] = None  # MLP hidden width; None = 4*d (gelu) or Llama's 8/3*d rule (swiglu)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    # None: plain RoPE. {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}: Llama 3.1's long-context frequency scaling (see model.rope_cache)
    rope_scaling: Optional[dict[str, Any]] = None
    tie_embeddings: bool = True
    bias: bool = True
    # bias on the q/k/v projections alone; None = ``bias`` (Qwen2: True with bias=False)
    qkv_bias: Optional[bool] = None
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # "torch": PyTorch ops; "triton": lightning_perf.kernels' fused norms, MLP activations and the chunked
    # LM-head cross-entropy (each falls back to PyTorch where it cannot run, e.g. CPU or an unsupported dtype)
    kernels: Literal["torch", "triton"] = "torch"
    # "sdpa": F.scaled_dot_product_attention (cuDNN where available); "auto": per (shape, dtype, device) the
    # fastest of each SDPA backend, FlexAttention and the installed FlashAttention 3 / 4, timed once on first
    # use (SDPA on CPU), the choice logged; "flex", "fa3", "fa4", "triton" (our kernel): that one, SDPA where
    # it cannot run (CPU, a shape it refuses)
    attention: Literal["auto", "triton", "sdpa", "flex", "fa3", "fa4"] = "sdpa"
    # one matmul for q, k and v (their weights concatenated at compute time; parameters and state
    # dict unchanged): one wider weight-gradient matmul instead of three narrow ones, most useful
    # under tensor parallelism where each projection shard is narrow
    fused_qkv: bool = False
    # the blocks' linears (attention and MLP projections, not the LM head) run their forward and both
    # gradient matmuls in FP8 through torchao.float8 (lightning_perf.kernels.torchao_fp8): "tensorwise"
    # (True means this) or "rowwise" scales, or "delayed" (tensorwise scales from each layer's last 16
    # amaxes, recorded by the casts: one read per operand; one device or DDP-like data parallelism);
    # parameters, optimizer state and checkpoints stay as they are
    fp8: Union[bool, Literal["tensorwise", "rowwise", "delayed"]] = False

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.intermediate_size is None:
            if self.activation == "swiglu":
                # Llama rule: 2/3 of 4d, rounded up to a multiple of 256
                self.intermediate_size = _pad(int(8 * self.n_embd / 3), 256)
            else:
                self.intermediate_size = 4 * self.n_embd
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with the numbers when the shape is impossible."""
        for field, allowed in (
            ("norm", _NORMS),
            ("activation", _ACTIVATIONS),
            ("positions", _POSITIONS),
            ("kernels", _KERNELS),
            ("attention", _ATTENTION),
        ):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"GPTConfig.{field}={value!r} is not one of {allowed}")
        if self.attention in ("flex", "fa3", "fa4"):
            from lightning_perf.kernels.attention_backends import missing_requirement

            missing = missing_requirement(self.attention)
            if missing:
                raise ValueError(f"GPTConfig: {missing}; or use attention='auto', which times the installed ones")
        if not isinstance(self.fused_qkv, bool):
            raise ValueError(f"GPTConfig.fused_qkv must be True or False, got {self.fused_qkv!r}")
        try:
            self.fp8 = normalize_fp8(self.fp8)
        except ValueError as err:
            raise ValueError(f"GPTConfig.{err}") from None
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "pad_vocab_multiple"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{field} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"{self.n_embd} / {self.n_head} = {self.n_embd / self.n_head:.3f}"
            )
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}) for grouped-query attention"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got n_embd/n_head = {self.head_dim}")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"GPTConfig.rope_scaling: rope_type {kind!r} is not supported (only 'llama3')")
            missing = sorted(set(_LLAMA3_ROPE_KEYS) - set(self.rope_scaling))
            if missing:
                raise ValueError(f"GPTConfig.rope_scaling (llama3) lacks {missing}")
            if self.positions != "rope":
                raise ValueError("GPTConfig.rope_scaling needs positions='rope'")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return _pad(self.vocab_size, self.pad_vocab_multiple)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "GPTConfig":
        """A preset by name (``GPTConfig.from_name("gpt2-124m", block_size=512)``)."""
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"Unknown GPT preset {name!r}. Known presets: {', '.join(sorted(PRESETS))}")
        fields = dict(PRESETS[key])
        fields.update(overrides)
        return cls(name=key, **fields)

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    def check_parallel_layout(
        self, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, stages_per_rank: int = 1
    ) -> None:
        """Raise ``ValueError`` with the numbers when the GPT cannot be split this way.

        The 3D model protocol's layout check: the strategy calls it with numbers alone, before
        any process group starts. Tensor parallelism needs whole heads and rows on every rank;
        pipeline parallelism needs the blocks to fill the stages evenly (a tied LM head is held
        by the first and the last stage alike).
        """
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        if tp > 1:
            for what, value in (
                ("n_head", self.n_head),
                ("n_kv_head", self.n_kv_head),
                ("intermediate_size", self.intermediate_size),
                ("padded_vocab_size", self.padded_vocab_size),
            ):
                if value % tp:
                    raise ValueError(
                        f"{what} ({value}) is not divisible by tensor_parallel_size ({tp}): "
                        f"{value} / {tp} = {value / tp:.3g}; each tensor-parallel rank needs whole "
                        f"{'heads' if 'head' in what else 'rows'}"
                    )
        stages = pp * stages_per_rank
        if self.n_layer % stages:
            raise ValueError(
                f"n_layer ({self.n_layer}) is not divisible by pipeline stages: pp({pp}) * stages_per_rank"
                f"({stages_per_rank}) = {stages}, {self.n_layer} / {stages} = {self.n_layer / stages:.3g}"
            )

    # ---- sizes -------------------------------------------------------------------------------

    def num_params(self, include_embedding: Union[bool, Literal["blocks"]] = True) -> int:
        """Parameter count of the model this config builds (computed, not instantiated).

        ``include_embedding=False`` leaves out the token and position embeddings but keeps
        the LM head (counted once when tied: the tied matrix does the head's matmul).
        ``include_embedding="blocks"`` counts the transformer blocks alone.
        """
        d, V, L = self.n_embd, self.padded_vocab_size, self.n_layer
        kv = self.n_kv_head * self.head_dim
        b = 1 if self.bias else 0
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)  # weight (+ layernorm bias)
        qb = 1 if self.qkv_bias else 0
        attn = d * d + 2 * d * kv + d * d + qb * (d + 2 * kv) + b * d
        f = self.intermediate_size
        if self.activation == "swiglu":
            mlp = 3 * d * f + b * (2 * f + d)
        else:
            mlp = 2 * d * f + b * (f + d)
        block = attn + mlp + 2 * norm
        body = L * block + norm  # + final norm
        if include_embedding == "blocks":  # the transformer blocks alone
            return L * block
        tok = V * d
        pos = self.block_size * d if self.positions == "learned" else 0
        head = V * d
        if include_embedding:
            return body + tok + pos + (0 if self.tie_embeddings else head)
        return body + head

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Model FLOPs per trained token (forward + backward), causal attention counted once.

        ``6 * N + 6 * L * d * T`` where N is the non-embedding parameter count including
        the LM head (every parameter does a multiply-add per token forward, twice that
        backward) and ``6 * L * d * T`` is the attention score and value matmuls
        (``2 * 2 * d * T`` forward per layer over the full square, halved for the causal
        mask, times three for backward). The other common convention counts
        ``12 * L * d * T`` (the full square); see :meth:`flops_per_token_full_attention`.
        """
        return 6 * self.num_params(include_embedding=False) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: Optional[int] = None, activation_checkpointing: str = "none") -> int:
        """The attention part of :meth:`flops_per_token` (``6 * L * d * T``), or of
        :meth:`hardware_flops_per_token` with ``activation_checkpointing="full"`` (``8 * L * d * T``:
        the forward runs again). Linear in T, so a packed row of documents of lengths ``L_i`` does
        ``6 * L * d * sum_i L_i**2`` (``lightning_perf.perf.documents``)."""
        T = self.block_size if seq_len is None else seq_len
        forwards = 4 if activation_checkpointing == "full" else 3
        return 2 * forwards * self.n_layer * self.n_embd * T

    def hardware_flops_per_token(self, seq_len: Optional[int] = None, activation_checkpointing: str = "none") -> int:
        """FLOPs per token the hardware executes, recomputation included (for HFU).

        ``full`` checkpointing runs each block's forward again in backward, up to the last
        activation backward needs: PyTorch's non-reentrant checkpoint stops before the MLP's
        down projection, whose output nothing saves. That adds
        ``2 * (N_blocks - L * N_down_proj) + 2 * L * d * T`` (causal attention counted once).
        ``selective`` recomputes only norms and elementwise ops, whose FLOPs are negligible
        next to the matmuls, so it equals :meth:`flops_per_token`.
        """
        T = self.block_size if seq_len is None else seq_len
        model = self.flops_per_token(T)
        if activation_checkpointing == "full":
            down_proj = self.intermediate_size * self.n_embd + (self.n_embd if self.bias else 0)
            recomputed = self.num_params("blocks") - self.n_layer * down_proj
            return model + 2 * recomputed + self.attention_flops_per_token(T, "full") - self.attention_flops_per_token(T)
        return model

    def flops_per_token_full_attention(self, seq_len: Optional[int] = None) -> int:
        """Model FLOPs per token with attention counted over the full square (the other common convention)."""
        T = self.block_size if seq_len is None else seq_len
        return 6 * self.num_params(include_embedding=False) + 12 * self.n_layer * self.n_embd * T


_GPT2 = dict(vocab_size=50257, norm="layernorm", activation="gelu", positions="learned", tie_embeddings=True, bias=True)
_LLAMA3 = dict(
    vocab_size=128256,
    norm="rmsnorm",
    activation="swiglu",
    positions="rope",
    rope_theta=500000.0,
    tie_embeddings=False,
    bias=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    # byte-level vocabulary (256 bytes + 4 specials, padded to 320); ~3.3M parameters, for CPU demos
    "tiny": dict(
        vocab_size=260, block_size=256, n_layer=4, n_head=4, n_embd=256, norm="layernorm",
        activation="gelu", positions="learned", tie_embeddings=True, bias=True,
    ),
    # same size, Llama style (RMSNorm, RoPE, SwiGLU, GQA 4:2, untied head)
    "tiny-llama": dict(
        vocab_size=260, block_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=256, norm="rmsnorm",
        activation="swiglu", positions="rope", tie_embeddings=False, bias=False,
    ),
    "gpt2-124m": dict(_GPT2, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": dict(_GPT2, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": dict(_GPT2, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-1.5b": dict(_GPT2, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    # GPT-2 style at 1.3B parameters: the benchmarks' mid-size model
    "gpt-1.3b": dict(_GPT2, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
    # Llama 3.2 1B / 3B and Llama 3.1 8B shapes (head untied here)
    "llama-1b": dict(_LLAMA3, block_size=4096, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192),
    "llama-3b": dict(_LLAMA3, block_size=4096, n_layer=28, n_head=24, n_kv_head=8, n_embd=3072, intermediate_size=8192),
    "llama-8b": dict(_LLAMA3, block_size=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336),
}
