"""Hugging Face checkpoints in and out: ``config.json`` <-> :class:`GPTConfig`, safetensors <-> the GPT.

Two families map onto the GPT exactly:

- Llama (``LlamaForCausalLM``, and the Llama-compatible ``MistralForCausalLM`` and
  ``Qwen2ForCausalLM``): RMSNorm, SwiGLU, RoPE (``rope_theta``, Llama 3 ``rope_scaling``),
  grouped-query attention, tied or untied head. Hugging Face's rotate-half RoPE is the
  GPT's (first half, second half), so q and k weights load as they are.
- GPT-2 (``GPT2LMHeadModel``): LayerNorm, tanh-GELU, learned positions, tied head. Its
  ``Conv1D`` weights are stored (in, out), the transpose of ``nn.Linear``'s, and ``c_attn``
  holds q, k and v stacked along the output: it splits into the GPT's three projections.

One table (:func:`weight_table`) names, for every GPT tensor, the Hugging Face tensor it
comes from (key, transpose, row range); loading reads it one way, saving the other.
``config.json`` is plain JSON: nothing here imports ``transformers``. ``safetensors`` is
the ``hf`` extra, imported when a checkpoint is read or written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from lightning_perf.kernels.dtensor import is_dtensor
from lightning_perf.models.gpt.config import GPTConfig
from lightning_perf.parallel.checkpointing.checkpoint_io import torch_load_weights

__all__ = [
    "ARCHITECTURES",
    "HFWeights",
    "WeightSource",
    "check_hf_weights",
    "config_from_hf",
    "full_state_dict",
    "hf_config",
    "hf_family",
    "hf_state_dict",
    "load_hf_weights",
    "read_hf_config",
    "require_safetensors",
    "save_hf",
    "weight_table",
]

#: Hugging Face architecture -> the GPT family that loads it
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2"}
# tensors a checkpoint may hold that the GPT derives or never uses: RoPE tables, GPT-2's causal mask
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are tanh-approximated GELU, the GPT's


def require_safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as err:
        raise ImportError(
            "reading and writing Hugging Face checkpoints needs safetensors: pip install 'lightning-perf[hf]'"
        ) from err
    return safetensors


# ---- config.json <-> GPTConfig --------------------------------------------------------------------


def read_hf_config(path: Union[str, Path]) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    return json.loads(file.read_text())


def hf_family(hf: dict[str, Any]) -> str:
    """``"llama"`` or ``"gpt2"`` from ``architectures`` (or ``model_type``); refuses the others by name."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and hf.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf["model_type"]]
    raise ValueError(
        f"config.json: architectures={archs} (model_type={hf.get('model_type')!r}) is not supported; "
        f"the GPT loads {', '.join(ARCHITECTURES)}"
    )


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"config.json: {field}={value!r} {why}")


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """``rope_theta`` and the Llama 3 scaling, from either the ``rope_theta`` + ``rope_scaling`` fields
    or the newer single ``rope_parameters`` dict."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        _refuse("rope_scaling.rope_type", kind, "is not supported (the GPT has default and llama3 RoPE)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        _refuse("rope_scaling", scaling, f"lacks {missing}")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict); ``overrides`` change other fields
    (``block_size``, ``kernels``, ``attention``, ``pad_vocab_multiple``, ...).

    The vocabulary is not padded (``pad_vocab_multiple=1``) unless asked: padded head rows add
    logits of 0 that a pretrained model never learnt to push down (GPT-2's logits sit far below 0).
    """
    family = hf_family(hf)
    name = f"hf-{hf.get('model_type', family)}"
    if family == "gpt2":
        fields = _gpt2_fields(hf)
    else:
        fields = _llama_fields(hf)
    fields.update(name=name, vocab_size=int(hf["vocab_size"]), pad_vocab_multiple=1,
                  init_std=float(hf.get("initializer_range", 0.02)))
    fields.update(overrides)
    return GPTConfig(**fields)


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    d, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    model_type = hf.get("model_type", "llama")
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != d // nh:
        _refuse("head_dim", head_dim, f"differs from hidden_size / num_attention_heads = {d} / {nh} = {d // nh}")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf.get("hidden_act"), "is not supported (the GPT's SwiGLU uses silu)")
    theta, scaling = _rope_from_hf(hf)
    if model_type == "qwen2":
        if hf.get("use_sliding_window"):
            _refuse("use_sliding_window", True, "is not supported (the GPT attends over the whole block)")
        bias, qkv_bias = False, True
    else:
        attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            _refuse("attention_bias", attn_bias, f"with mlp_bias={mlp_bias} is not supported (one bias flag for both)")
        bias = qkv_bias = attn_bias
    block_size = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window") if model_type == "mistral" else None
    if window is not None and int(window) < block_size:
        block_size = int(window)  # exact up to the window: longer sequences are refused, never silently wrong
    return dict(
        n_layer=int(hf["num_hidden_layers"]), n_head=nh, n_kv_head=int(hf.get("num_key_value_heads") or nh),
        n_embd=d, intermediate_size=int(hf["intermediate_size"]), block_size=block_size,
        norm="rmsnorm", activation="swiglu", positions="rope", rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), bias=bias, qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        _refuse("activation_function", act, f"is not supported (the GPT's GELU is the tanh one: {_GPT2_ACTIVATIONS})")
    if not hf.get("scale_attn_weights", True):
        _refuse("scale_attn_weights", False, "is not supported (the GPT scales scores by 1/sqrt(head_dim))")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        _refuse("scale_attn_by_inverse_layer_idx", True, "is not supported")
    if hf.get("add_cross_attention", False):
        _refuse("add_cross_attention", True, "is not supported (decoder-only)")
    d = int(hf["n_embd"])
    return dict(
        n_layer=int(hf["n_layer"]), n_head=int(hf["n_head"]), n_embd=d,
        intermediate_size=int(hf.get("n_inner") or 4 * d), block_size=int(hf.get("n_positions", 1024)),
        norm="layernorm", activation="gelu", positions="learned", bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def hf_config(config: GPTConfig, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a GPT; refuses a GPT no Hugging Face architecture matches."""
    c = config
    dtype_name = str(dtype).removeprefix("torch.")
    if (c.norm, c.activation, c.positions) == ("rmsnorm", "swiglu", "rope"):
        if c.bias and not c.qkv_bias:
            raise ValueError("GPTConfig(bias=True, qkv_bias=False) has no Hugging Face architecture")
        qwen2 = c.qkv_bias and not c.bias
        out: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
            "hidden_size": c.n_embd, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim,
            "hidden_act": "silu", "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
            "tie_word_embeddings": c.tie_embeddings, "vocab_size": c.vocab_size,
            "initializer_range": c.init_std, "torch_dtype": dtype_name,
        }
        if qwen2:
            out["use_sliding_window"] = False
        else:
            out.update(attention_bias=c.bias, mlp_bias=c.bias)
        return out
    if (c.norm, c.activation, c.positions) == ("layernorm", "gelu", "learned"):
        if not (c.bias and c.qkv_bias) or c.n_kv_head != c.n_head:
            raise ValueError(
                f"GPT-2 needs bias=True and n_kv_head == n_head; this GPTConfig has bias={c.bias}, "
                f"qkv_bias={c.qkv_bias}, n_kv_head={c.n_kv_head}, n_head={c.n_head}"
            )
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.intermediate_size,
            "n_positions": c.block_size, "n_ctx": c.block_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": c.norm_eps, "vocab_size": c.vocab_size, "tie_word_embeddings": c.tie_embeddings,
            "initializer_range": c.init_std, "torch_dtype": dtype_name,
        }
    raise ValueError(
        f"no Hugging Face architecture matches GPTConfig(norm={c.norm!r}, activation={c.activation!r}, "
        f"positions={c.positions!r}): Llama is rmsnorm/swiglu/rope, GPT-2 layernorm/gelu/learned"
    )


# ---- the weight table ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WeightSource:
    """Where a GPT tensor lives in a Hugging Face checkpoint: ``key``, stored transposed or not, and the
    row range it takes there (after the transpose); ``vocab_rows``: the GPT pads these rows to
    ``padded_vocab_size``."""

    key: str
    transpose: bool = False
    rows: Optional[tuple[int, int]] = None
    vocab_rows: bool = False


def weight_table(config: GPTConfig, family: str, *, prefix: str = "") -> dict[str, WeightSource]:
    """GPT state-dict name -> :class:`WeightSource`, for the whole model."""
    S = WeightSource
    table: dict[str, WeightSource] = {}
    c = config
    if family == "llama":
        table["tok_emb.weight"] = S(key="model.embed_tokens.weight", vocab_rows=True)
        for i in range(c.n_layer):
            hf, gpt = f"model.layers.{i}.", f"blocks.{i}."
            table[gpt + "attn_norm.weight"] = S(key=hf + "input_layernorm.weight")
            table[gpt + "mlp_norm.weight"] = S(key=hf + "post_attention_layernorm.weight")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                table[f"{gpt}attn.{proj}.weight"] = S(key=f"{hf}self_attn.{proj}.weight")
                if c.qkv_bias if proj != "o_proj" else c.bias:
                    table[f"{gpt}attn.{proj}.bias"] = S(key=f"{hf}self_attn.{proj}.bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                table[f"{gpt}mlp.{proj}.weight"] = S(key=f"{hf}mlp.{proj}.weight")
                if c.bias:
                    table[f"{gpt}mlp.{proj}.bias"] = S(key=f"{hf}mlp.{proj}.bias")
        table["norm.weight"] = S(key="model.norm.weight")
    elif family == "gpt2":
        p, d, kv = prefix, c.n_embd, c.n_kv_head * c.head_dim
        table["tok_emb.weight"] = S(key=p + "wte.weight", vocab_rows=True)
        table["pos_emb.weight"] = S(key=p + "wpe.weight")
        for i in range(c.n_layer):
            hf, gpt = f"{p}h.{i}.", f"blocks.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                table[f"{gpt}{ours}.weight"] = S(key=f"{hf}{theirs}.weight")
                table[f"{gpt}{ours}.bias"] = S(key=f"{hf}{theirs}.bias")
            rows = ((0, d), (d, d + kv), (d + kv, d + 2 * kv))  # c_attn's output: [q; k; v]
            for proj, (a, b) in zip(("q_proj", "k_proj", "v_proj"), rows):
                table[f"{gpt}attn.{proj}.weight"] = S(key=f"{hf}attn.c_attn.weight", transpose=True, rows=(a, b))
                table[f"{gpt}attn.{proj}.bias"] = S(key=f"{hf}attn.c_attn.bias", rows=(a, b))
            linears = (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj"))
            for ours, theirs in linears:
                table[f"{gpt}{ours}.weight"] = S(key=f"{hf}{theirs}.weight", transpose=True)
                table[f"{gpt}{ours}.bias"] = S(key=f"{hf}{theirs}.bias")
        table["norm.weight"] = S(key=p + "ln_f.weight")
        table["norm.bias"] = S(key=p + "ln_f.bias")
    else:
        raise ValueError(f"unknown family {family!r}")
    if not c.tie_embeddings:
        table["lm_head.weight"] = S(key="lm_head.weight", vocab_rows=True)
    return table


# ---- reading ---------------------------------------------------------------------------------------


class HFWeights:
    """The tensors of a checkpoint folder, read one at a time: ``model.safetensors``, sharded safetensors
    (``model.safetensors.index.json``), or ``pytorch_model.bin`` (sharded or not)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self._files: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        self._torch_state: dict[Path, dict[str, torch.Tensor]] = {}
        st_index, st_single = self.path / "model.safetensors.index.json", self.path / "model.safetensors"
        pt_index, pt_single = self.path / "pytorch_model.bin.index.json", self.path / "pytorch_model.bin"
        if st_index.is_file() or pt_index.is_file():
            index = st_index if st_index.is_file() else pt_index
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {k: self.path / f for k, f in weight_map.items()}
        elif st_single.is_file():
            self._files = {k: st_single for k in self._open(st_single).keys()}
        elif pt_single.is_file():
            self._files = {k: pt_single for k in self._open(pt_single)}
        else:
            raise FileNotFoundError(
                f"{self.path} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
            )

    def _open(self, file: Path) -> Any:
        if file.suffix == ".safetensors":
            if file not in self._handles:
                safetensors = require_safetensors()
                self._handles[file] = safetensors.safe_open(str(file), framework="pt")
            return self._handles[file]
        if file not in self._torch_state:
            self._torch_state[file] = torch_load_weights(file, map_location="cpu", mmap=True)
        return self._torch_state[file]

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def _handle(self, key: str) -> Any:
        if key not in self._files:
            raise KeyError(f"{self.path}: the checkpoint has no tensor {key!r}")
        return self._open(self._files[key])

    def get(self, key: str) -> torch.Tensor:
        handle = self._handle(key)
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]

    def shape(self, key: str) -> torch.Size:
        """The stored shape, from the file's header alone."""
        handle = self._handle(key)
        return torch.Size(handle.get_slice(key).get_shape() if hasattr(handle, "get_slice") else handle[key].shape)

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]``, reading only those elements from a safetensors file."""
        handle = self._handle(key)
        return handle.get_slice(key)[index] if hasattr(handle, "get_slice") else handle[key][index].clone()


def _gpt2_prefix(weights: HFWeights) -> str:
    return "transformer." if "transformer.wte.weight" in weights else ""


def _clean_name(name: str) -> str:
    """A parameter name without the wrappers compile and activation checkpointing may add."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _source_shape(weights: HFWeights, name: str, src: WeightSource, shape: torch.Size, config: GPTConfig) -> None:
    """Raise, naming both keys, when the stored tensor does not give the GPT's ``name`` of ``shape`` (headers only)."""
    stored = weights.shape(src.key)
    if src.transpose and len(stored) != 2:
        raise ValueError(
            f"shape mismatch: {src.key} {tuple(stored)} is not a matrix, the GPT's {name} is {tuple(shape)}"
        )
    t = list(reversed(stored)) if src.transpose else list(stored)
    if src.rows is not None:
        if len(t) < 1 or t[0] < src.rows[1]:
            raise ValueError(
                f"shape mismatch: {src.key} {tuple(stored)} has no rows {src.rows} for the GPT's {name} {tuple(shape)}"
            )
        t[0] = src.rows[1] - src.rows[0]
    if src.vocab_rows:
        if t[0] != config.vocab_size:
            raise ValueError(
                f"vocabulary mismatch: {src.key} has {t[0]} rows but the GPT's vocab_size is {config.vocab_size}"
            )
        t[0] = config.padded_vocab_size
    if torch.Size(t) != shape:
        raise ValueError(
            f"shape mismatch: {src.key} {tuple(stored)} gives {tuple(t)} for the GPT's {name} {tuple(shape)}"
        )


def _read_box(weights: HFWeights, src: WeightSource, config: GPTConfig, index: tuple[slice, ...]) -> torch.Tensor:
    """The GPT tensor's ``index`` box (one slice per dim), reading only the stored elements it covers.

    The GPT tensor is the stored one transposed (``src.transpose``), cut to ``src.rows`` and padded with
    zero rows past the vocabulary (``src.vocab_rows``); the box is mapped back through those steps.
    """
    a, b = index[0].start, index[0].stop
    real = max(a, min(b, config.vocab_size)) if src.vocab_rows else b  # rows past it are padding
    shift = src.rows[0] if src.rows is not None else 0
    rows = slice(a + shift, real + shift)
    stored_index = (index[1], rows) if src.transpose else (rows, *index[1:])
    t = weights.read(src.key, stored_index)
    if src.transpose:
        t = t.t()
    if real < b:
        t = torch.cat([t, t.new_zeros(b - real, *t.shape[1:])])
    return t


@torch.no_grad()
def _fill(param: torch.Tensor, weights: HFWeights, src: WeightSource, config: GPTConfig) -> None:
    """Fill ``param``, or its local shard when ``param`` is a DTensor, with only the elements it holds."""
    if is_dtensor(param):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        target = param.to_local()
    else:
        shape, offset, target = tuple(param.shape), (0,) * param.dim(), param
    if target.numel() == 0:
        return
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    target.copy_(_read_box(weights, src, config, index).to(target.dtype))


def _table_for(weights: HFWeights, path: Union[str, Path], config: GPTConfig) -> dict[str, WeightSource]:
    """The weight table of the checkpoint at ``path``; raises for a tensor the GPT would leave unused."""
    family = hf_family(read_hf_config(path))
    table = weight_table(config, family, prefix=_gpt2_prefix(weights) if family == "gpt2" else "")
    used = {src.key for src in table.values()}
    unused = [k for k in weights.keys() if k not in used and not k.endswith(_IGNORED_SUFFIXES)
              and not (config.tie_embeddings and k == "lm_head.weight")]
    if unused:
        raise ValueError(
            f"{path} holds tensors the GPT ({family}) has no place for, e.g. {unused[:4]}: "
            "a different architecture, or a config.json that does not describe these weights"
        )
    return table


def _source(table: dict[str, WeightSource], name: str) -> WeightSource:
    clean = _clean_name(name)
    if clean not in table:
        raise KeyError(f"the GPT's {clean} has no Hugging Face counterpart in this checkpoint")
    return table[clean]


def check_hf_weights(model: nn.Module, path: Union[str, Path]) -> None:
    """Raise, naming the keys, unless the checkpoint at ``path`` fills ``model`` (a GPT, on ``meta`` or
    not, whose ``config`` is its :class:`GPTConfig`) exactly.

    Reads the files' headers only (no tensor data) and needs no process group: a mismatched vocabulary or
    shape, a missing tensor or one the GPT would leave unused fails before any process starts.
    """
    config = model.config
    weights = HFWeights(path)
    table = _table_for(weights, path, config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for name, shape in shapes.items():
        src = _source(table, name)
        if src.key not in weights:
            raise KeyError(f"{path}: the checkpoint has no tensor {src.key!r} (for the GPT's {name})")
        _source_shape(weights, name, src, shape, config)


def load_hf_weights(model: nn.Module, path: Union[str, Path]) -> None:
    """Fill ``model``'s materialised parameters (whole, a pipeline stage's subset, or sharded DTensors)
    from the checkpoint folder ``path``; every rank reads only the elements of the shards it holds.

    Raises, naming the tensor, on a missing or misshapen tensor, or one the GPT would leave unused.
    """
    weights = HFWeights(path)
    config = model.config
    table = _table_for(weights, path, config)
    params = list(model.named_parameters())
    for name, param in params:  # every check before the first copy
        src = _source(table, name)
        if param.is_meta:
            raise RuntimeError(
                f"{_clean_name(name)} is on the meta device: materialise the model (to_empty) before loading"
            )
        _source_shape(weights, _clean_name(name), src, param.shape, config)
    for name, param in params:
        _fill(param, weights, _source(table, name), config)
    model.init_rope()


# ---- writing ---------------------------------------------------------------------------------------


def hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of a GPT state dict (whole tensors; vocabulary rows unpadded)."""
    family = "gpt2" if config.positions == "learned" else "llama"
    table = weight_table(config, family, prefix="transformer." if family == "gpt2" else "")
    state = {_clean_name(k): v for k, v in state.items()}
    missing = [k for k in table if k not in state]
    if missing:
        raise KeyError(f"the state dict lacks {len(missing)} GPT tensors, e.g. {missing[:3]}")
    parts: dict[str, list[tuple[int, torch.Tensor, WeightSource]]] = {}
    for name, src in table.items():
        t = state[name].detach()
        if src.vocab_rows:
            t = t[: config.vocab_size]
        parts.setdefault(src.key, []).append((src.rows[0] if src.rows else 0, t, src))
    out: dict[str, torch.Tensor] = {}
    for key, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        t = torch.cat([p[1] for p in pieces]) if len(pieces) > 1 else pieces[0][1]
        if pieces[0][2].transpose:
            t = t.t()
        out[key] = t.contiguous()
    return out


def save_hf(
    state: dict[str, torch.Tensor], config: GPTConfig, path: Union[str, Path], *, dtype: Optional[torch.dtype] = None
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for a GPT's whole state dict into the folder ``path``."""
    safetensors = require_safetensors()
    tensors = hf_state_dict(state, config)
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    tensors = {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()}
    hf = hf_config(config, dtype=dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with DTensor shards gathered into whole tensors (a collective when sharded)."""
    return {k: (v.full_tensor() if is_dtensor(v) else v) for k, v in model.state_dict().items()}


