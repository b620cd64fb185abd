"""A decoder-only transformer: GPT-2 and Llama shapes from one config.

Read top to bottom: norm -> rotary -> attention -> MLP -> block -> model.
Built on any device (``meta`` included: nothing is allocated there), then
``init_weights()`` fills the parameters, also after they were sharded.
Blocks live in an ``nn.ModuleDict`` keyed by layer index, so a pipeline stage
can keep a contiguous range of them under their original names.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_perf.kernels.document_mask import document_positions
from lightning_perf.kernels.dtensor import is_dtensor
from lightning_perf.kernels.torchao_fp8 import (
    convert_to_fp8,
    delayed_gelu_mlp,
    fp8_matmul,
    is_fp8_linear,
    reset_amax_history,
)
from lightning_perf.models.gpt import hf, ops
from lightning_perf.models.gpt.config import GPTConfig
from lightning_perf.models.gpt.parallelize import gpt_pipeline_stage, gpt_tensor_parallel_plan

__all__ = ["GPT", "Block", "Attention", "MLP", "Norm", "rope_cache", "apply_rope"]


class Norm(nn.Module):
    """LayerNorm (weight + optional bias) or RMSNorm (weight only), dispatched through ``ops.norm``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind = config.norm
        self.eps = config.norm_eps
        self.impl = config.kernels
        self.weight = nn.Parameter(torch.empty(config.n_embd))
        use_bias = config.norm == "layernorm" and config.bias
        self.bias = nn.Parameter(torch.empty(config.n_embd)) if use_bias else None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.norm(x, self.weight, self.bias, kind=self.kind, eps=self.eps, impl=self.impl)


def llama3_scaled_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 RoPE scaling: wavelengths above ``original / low_freq_factor`` are divided by ``factor``,
    those below ``original / high_freq_factor`` kept, and the band between interpolated:
    ``f' = (1 - s) * f / factor + s * f`` with ``s = (original / wavelength - low) / (high - low)``."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, mid, out)


def rope_cache(
    seq_len: int, head_dim: int, theta: float, device: torch.device, scaling: Optional[dict[str, Any]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim // 2), computed in fp32 (``scaling``: GPTConfig.rope_scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) by the position angle. x: (B, nh, T, hd)."""
    return ops.rope(x, cos, sin)


def _to_fp8(module: nn.Module, config: GPTConfig) -> None:
    """With ``config.fp8``, the module's projections become torchao FP8 linears (same parameters)."""
    if config.fp8:
        convert_to_fp8(module, config.fp8)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (column-parallel friendly) and GQA."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hd = config.n_embd, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, hd
        self.q_proj = nn.Linear(d, config.n_head * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, config.n_kv_head * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, config.n_kv_head * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_head * hd, d, bias=config.bias)
        self.rope = config.positions == "rope"
        self.impl = config.attention
        self.kernels = config.kernels
        self.fused_qkv = config.fused_qkv
        # set by GPT.enable_context_parallel: attention over keys held by other ranks too
        self.attention_fn: Optional[Callable[..., torch.Tensor]] = None
        _to_fp8(self, config)

    def _fused_qkv_ok(self) -> bool:
        """One q/k/v matmul, unless the projections are FP8 and their weights tensor-parallel or
        already gathered in FP8 (each with its own scale): then each projection runs as it is."""
        if not is_fp8_linear(self.q_proj):
            return True
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

        return not any(is_dtensor(p.weight) or tensor_already_casted_to_fp8(p.weight)
                       for p in (self.q_proj, self.k_proj, self.v_proj))

    def _qkv_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (each (..., width)) from one matmul over the three weights concatenated by rows.

        Under tensor parallelism the weights are column-parallel DTensor shards: their local rows are
        concatenated into one local weight (this rank's q, k and v rows, a row-permuted shard of a
        global [Wq; Wk; Wv]), so the matmul's local output columns are this rank's q, k and v, and
        each weight's gradient flows back to its own shard. The projections' own forward (and any
        TP hooks on them) is bypassed; the attention input's layout hooks still apply. A projection whose
        ``bias_after_matmul`` is true (its forward adds the bias after a bias-free matmul) is computed so here too.
        """
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = self.q_proj.weight
        bias_after = getattr(self.q_proj, "bias_after_matmul", False)
        if is_dtensor(weight):
            from torch.distributed.tensor import DTensor, Replicate

            mesh, placements = weight.device_mesh, weight.placements
            w = DTensor.from_local(torch.cat([p.weight.to_local() for p in projs]), mesh, placements,
                                   run_check=False)
            b = None
            if self.q_proj.bias is not None:
                b = DTensor.from_local(torch.cat([p.bias.to_local() for p in projs]), mesh, placements,
                                       run_check=False)
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            y = F.linear(x, w) + b if (b is not None and bias_after) else F.linear(x, w, b)
            y = y.to_local()
            widths = [p.weight.to_local().shape[0] for p in projs]
        else:
            w = torch.cat([p.weight for p in projs])
            b = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
            if is_fp8_linear(self.q_proj):
                y = fp8_matmul(x, w, self.q_proj)
                y = y + b.to(y.dtype) if b is not None else y
            else:
                y = F.linear(x, w, b)
            widths = [p.weight.shape[0] for p in projs]
        q, k, v = y.split(widths, dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = x.shape
        # heads are read from the projection width so a tensor-parallel shard sees its local heads
        if self.fused_qkv and self._fused_qkv_ok():
            q, k, v = self._qkv_fused(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if self.rope:
            assert rope is not None
            q, k = ops.rope(q, *rope, impl=self.kernels), ops.rope(k, *rope, impl=self.kernels)
        if self.attention_fn is not None:
            if doc_ids is not None:
                raise ValueError("packed documents (doc_ids) are not supported under context parallelism")
            y = self.attention_fn(q, k, v)  # (B, nh, T, hd), causal over the global positions
        else:
            y = ops.attention(q, k, v, causal=True, impl=self.impl, doc_ids=doc_ids)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.o_proj(y)


class MLP(nn.Module):
    """GPT-2: down(gelu_tanh(up(x))). Llama: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, f = config.n_embd, config.intermediate_size
        self.kind = config.activation
        self.impl = config.kernels
        self.up_proj = nn.Linear(d, f, bias=config.bias)
        self.gate_proj = nn.Linear(d, f, bias=config.bias) if self.kind == "swiglu" else None
        self.down_proj = nn.Linear(f, d, bias=config.bias)
        self.delayed_fp8 = config.fp8 == "delayed"
        _to_fp8(self, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            h = ops.mlp_activation(self.gate_proj(x), self.up_proj(x), kind="swiglu", impl=self.impl)
        else:
            if self.delayed_fp8:  # GELU and its FP8 casts fused (kernels.torchao_fp8.delayed_gelu_mlp)
                y = delayed_gelu_mlp(x, self.up_proj, self.down_proj)
                if y is not None:
                    return y
            h = ops.mlp_activation(self.up_proj(x), None, kind="gelu", impl=self.impl)
        return self.down_proj(h)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = Norm(config)
        self.attn = Attention(config)
        self.mlp_norm = Norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.attn_norm(x)
        # doc_ids only as a keyword, only when given: tensor-parallel plans describe (x, rope)
        x = x + (self.attn(h, rope) if doc_ids is None else self.attn(h, rope, doc_ids=doc_ids))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token embedding -> blocks -> final norm -> LM head (tied to the embedding or not).

    ``forward(idx)`` returns logits (B, T, V_padded); ``forward(idx, targets)`` returns the
    mean cross-entropy without materialising logits outside the loss entry point.
    ``forward(idx, targets, doc_ids=...)`` trains on packed documents: ``doc_ids`` (B, T) numbers the
    documents of each row (``kernels.document_mask``), attention is document-causal and positions
    (learned or rotary) restart at 0 where each document starts.
    A pipeline stage keeps a subset: ``tok_emb`` / ``pos_emb`` on the first stage,
    ``norm`` / ``lm_head`` on the last (a tied head's ``lm_head`` there is the ``tok_emb``
    module itself: only its (V, d) weight is used); a missing embedding means the input is
    already hidden states, a missing head means the output is hidden states. The last stage's
    ``forward`` returns the final norm's output and :meth:`pipeline_loss` applies the head and the loss.
    """

    #: a Hugging Face checkpoint folder that ``init_weights()`` loads instead of drawing random values
    init_from_hf: Optional[str] = None
    #: a pipeline's last stage (:meth:`pipeline_stage`): ``forward`` without targets stops at the final norm and
    #: the schedule computes each microbatch's loss with :meth:`pipeline_loss`
    head_in_loss: bool = False

    def __init__(self, config: GPTConfig, *, init_from_hf: Optional[str] = None) -> None:
        super().__init__()
        self.config = config
        self.init_from_hf = None if init_from_hf is None else str(init_from_hf)
        V, d = config.padded_vocab_size, config.n_embd
        self.tok_emb: Optional[nn.Embedding] = nn.Embedding(V, d)
        self.pos_emb: Optional[nn.Embedding] = (
            nn.Embedding(config.block_size, d) if config.positions == "learned" else None
        )
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm: Optional[Norm] = Norm(config)
        self.lm_head: Optional[nn.Linear] = None if config.tie_embeddings else nn.Linear(d, V, bias=False)
        # RoPE tables are derived, never saved: rebuilt by init_rope() on the real device
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    # ---- initialisation ------------------------------------------------------------------

    def init_rope(self) -> None:
        if self.config.positions != "rope":
            return
        device = self._device()
        cfg = self.config
        cos, sin = rope_cache(cfg.block_size, cfg.head_dim, cfg.rope_theta, device, cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) for matrices, residual outputs scaled by 1/sqrt(2L), zero biases.

        Works on materialised sharded parameters (DTensors) as well as plain tensors. With
        ``init_from_hf`` set, every parameter (or its local shard) is read from that checkpoint instead.
        """
        if self.config.fp8 == "delayed":  # after to_empty the histories hold whatever memory held
            reset_amax_history(self)
        if self.init_from_hf is not None:
            hf.load_hf_weights(self, self.init_from_hf)
            return
        std = self.config.init_std
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_resid = name.endswith("o_proj") or name.endswith("down_proj")
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, Norm):
                module.reset_parameters()
        self.init_rope()

    def _device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    # ---- Hugging Face checkpoints (see hf.py) ---------------------------------------------

    @classmethod
    def from_hf(
        cls,
        path: Union[str, Path],
        *,
        device: Union[str, torch.device] = "cpu",
        dtype: torch.dtype = torch.float32,
        **config_overrides: Any,
    ) -> "GPT":
        """The GPT of a Hugging Face checkpoint folder (``config.json`` + safetensors or ``pytorch_model.bin``):
        Llama, Mistral, Qwen2 or GPT-2. ``config_overrides`` change :class:`GPTConfig` fields that leave the
        shapes alone (``block_size``, ``kernels``, ``attention``, ``pad_vocab_multiple``, ``fp8``, ...)."""
        config = hf.config_from_hf(hf.read_hf_config(path), **config_overrides)
        with torch.device("meta"):
            model = cls(config, init_from_hf=str(path))
        model.to_empty(device=device)
        model.to(dtype)
        model.init_weights()
        return model

    def save_hf(self, path: Union[str, Path], *, dtype: Optional[torch.dtype] = None) -> Path:
        """Write ``config.json`` and ``model.safetensors`` that Hugging Face ``transformers`` loads
        (``AutoModelForCausalLM.from_pretrained(path)``). Sharded parameters are gathered first, a
        collective every rank joins; then only global rank 0 writes."""
        state = hf.full_state_dict(self)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return Path(path)
        return hf.save_hf(state, self.config, path, dtype=dtype)

    # ---- forward -------------------------------------------------------------------------

    #: a target the loss ignores (``F.cross_entropy``'s ignore_index): a strategy that must pad a
    #: batch (batch-sharded tensor parallelism with a ragged last batch) pads the targets with it
    batch_padding_target = -100

    @property
    def head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.tok_emb is None:
            raise RuntimeError("this stage has a tied head but no embedding to tie it to")
        return self.tok_emb.weight

    def embed(self, idx: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d); ``positions``: the tokens' positions, (T,) (context
        parallelism: a part of longer sequences) or (B, T) (packed documents: restarting per document);
        default 0..T-1."""
        T = idx.shape[1]
        if positions is None and T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds the model's block_size {self.config.block_size}; "
                f"use a shorter seq_len or a config with block_size >= {T}"
            )
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device) if positions is None else positions)
        return x

    def rope(self, positions: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin tables: rows 0.. (the attention takes the first T); with ``positions`` (T,) their
        rows, with ``positions`` (B, T) the angles of each token, (B, 1, T, hd / 2)."""
        if self.config.positions != "rope":
            return None
        if self.rope_cos.numel() == 0 or self.rope_cos.device != self._device():
            self.init_rope()
        if positions is not None:
            if positions.dim() == 1:
                return self.rope_cos[positions], self.rope_sin[positions]
            return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        return self.rope_cos, self.rope_sin

    def forward_blocks(self, x: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                       positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        if doc_ids is not None and positions is None:
            positions = document_positions(doc_ids)
        rope = self.rope(positions)
        for block in self.blocks.values():
            x = block(x, rope) if doc_ids is None else block(x, rope, doc_ids=doc_ids)
        return x

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None, *, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``doc_ids`` (B, T): packed documents (positions restart at each one); ``positions`` (T,): the
        global positions of ``idx``'s tokens when they are a part of longer sequences (context
        parallelism); default 0..T-1. The two do not combine."""
        if doc_ids is not None:
            if positions is not None:
                raise ValueError("packed documents (doc_ids) are not supported under context parallelism")
            if doc_ids.shape != idx.shape[:2]:
                raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must have the (B, T) shape of the tokens "
                                 f"{tuple(idx.shape[:2])}")
            positions = document_positions(doc_ids)  # (B, T), 0 at each document's first token
        x = self.embed(idx, positions) if self.tok_emb is not None else idx  # (B, T, d)
        x = self.forward_blocks(x, doc_ids, positions)
        if self.norm is None:
            return x  # an inner pipeline stage hands hidden states on
        x = self.norm(x)
        if targets is None:
            if self.head_in_loss:
                return x  # (B, T, d): a pipeline's last stage, whose loss applies the head (pipeline_loss)
            return ops.lm_logits(x, self.head_weight)  # (B, T, V_padded)
        return self.lm_head_loss(x, targets)

    def lm_head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the LM head on the final norm's output ``x`` (a strategy may compile it)."""
        return ops.lm_loss(x, self.head_weight, targets, impl=self.config.kernels)

    def pipeline_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One microbatch's loss on a pipeline's last stage, from its output ``x`` (B, T, d), the final norm's.

        The head and the cross-entropy run together in :meth:`lm_head_loss`, compiled or fused as on a whole
        model, so the (B, T, V) logits stay inside it instead of being the stage's output, kept by the
        schedule until the microbatch's backward and then turned into fp32 by an eager cross-entropy.
        """
        if not self.head_in_loss:
            raise RuntimeError("pipeline_loss takes the output of a pipeline's last stage (GPT.pipeline_stage), "
                               "whose forward stops at the final norm; this GPT's forward returns logits")
        return self.lm_head_loss(x, targets)

    # ---- 3D parallelism protocol (see parallelize.py) -----------------------------------

    def tensor_parallel_plan(self, tp_mesh, *, sequence_parallel: Any = True) -> dict:
        """The ``parallelize_module`` plan for tensor (and sequence) parallelism over ``tp_mesh``."""
        return gpt_tensor_parallel_plan(self, tp_mesh, sequence_parallel=sequence_parallel)

    def enable_context_parallel(self, attention: Optional[Callable[..., torch.Tensor]]) -> None:
        """Every block's attention core becomes ``attention(q, k, v)`` (None: the local causal one)."""
        for block in self.blocks.values():
            block.attn.attention_fn = attention

    def pipeline_stage(self, stage_idx: int, num_stages: int) -> "GPT":
        """Stage ``stage_idx`` of ``num_stages``: a GPT sharing this one's modules under their names."""
        return gpt_pipeline_stage(self, stage_idx, num_stages)

    # ---- sizes ---------------------------------------------------------------------------

    def num_params(self, include_embedding: bool = True) -> int:
        return self.config.num_params(include_embedding)

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """``6 * N + 6 * L * d * T``: see :meth:`GPTConfig.flops_per_token`."""
        return self.config.flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """``6 * L * d * T``, the attention part of :meth:`flops_per_token`."""
        return self.config.attention_flops_per_token(seq_len)
