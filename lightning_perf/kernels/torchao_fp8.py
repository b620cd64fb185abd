"""FP8 training linears through ``torchao.float8``: recipes, conversion, the fused q/k/v matmul.

A converted linear computes y = x W^T (+ b) and both gradient matmuls on FP8 operands with fp32
accumulation (``torch._scaled_mm``), dynamic scales recomputed from the current tensors each call:

    tensorwise   s_t = fmax / amax(|t|)            one scale per tensor (the weights can be
                                                   all-gathered in FP8 under FSDP2)
    rowwise      s_t[i] = fmax / amax(|t[i, :]|)   one scale per row of each operand along the
                                                   contracted dimension (closer to bf16, slower)
    delayed      s_t = fmax / max of the last H amaxes of t (H = 16), tensorwise: each layer keeps
                 an amax history per operand (x, W, dL/dy) and the pass that casts an operand
                 also records its amax, so every operand is read once instead of twice; the first
                 call (an empty history) uses the current amax. A sudden jump past the recorded
                 maximum saturates at the FP8 maximum for one step. Plain weights only.

Parameters, optimizer state and checkpoints are unchanged: FP8 exists only inside the matmuls.
torchao owns the layer, the rowwise recipe, FSDP2's FP8 all-gather (``parallel.sharding.fp8_all_gather``)
and the FP8 tensor-parallel styles; this module picks the layers and the recipe. One exception:
a tensorwise layer whose weight is a plain tensor when it runs (one device, DDP, pipeline stages,
ZeRO gathering bf16/fp32 weights; not FP8-gathered or tensor-parallel) runs ``kernels.ops.fp8_linear``,
which keeps the forward's FP8 copies of x and W for the backward instead of casting them again
(the recipe's throughput on either path: benchmarks/RESULTS.md). Delayed layers always run
``kernels.ops.fp8_linear`` (with the amax history of ``kernels.ops.fp8_amax_history``; it needs
Triton), and two of them around a tanh GELU run ``kernels.ops.fp8_gelu_mlp``
(:func:`delayed_gelu_mlp`); a weight that is a DTensor or FP8-gathered is refused at the call, and
the pack's strategies refuse the recipe before any process group where they would make one.

The history (``fp8_amax_history``, (3, H) fp32) is a non-persistent buffer: state dicts and
checkpoints are those of the other recipes, and loading one into a model empties every history, so
the first step after a load falls back to the current amax, as the first step of a run does.
Evaluation (a module in eval mode) reads the history without recording.

torchao is an optional dependency (``pip install 'lightning-perf[fp8]'``). FP8 matmuls need a
GPU of compute capability >= 8.9 (Ada, Hopper and later) or a CPU build of PyTorch with FP8
``_scaled_mm`` (the tests run there); :func:`check_fp8_device` refuses anything else up front.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import logging
import re
import sys
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

__all__ = ["FP8_RECIPES", "normalize_fp8", "require_torchao", "require_fp8", "fp8_linear_config", "convert_to_fp8",
           "is_fp8_linear", "fp8_recipe_of", "fp8_matmul", "check_fp8_device", "fp8_linear_reference",
           "reset_amax_history", "uses_delayed_fp8", "delayed_gelu_mlp"]

FP8_RECIPES = ("tensorwise", "rowwise", "delayed")
_PACK = "lightning_perf.kernels.ops.fp8_linear"  # the pack's tensorwise matmul (needs Triton)
_PACK_MLP = "lightning_perf.kernels.ops.fp8_gelu_mlp"  # its fused GELU MLP for delayed layers (needs Triton)
_ALIGN = 16  # torch._scaled_mm: both dimensions of each FP8 operand divisible by 16
_TORCHAO_MIN = (0, 14)
_AMAX_HISTORY = 16  # delayed: steps each scale looks back over (kernels.ops.fp8_amax_history.AMAX_HISTORY)


def normalize_fp8(value: Union[bool, str, None]) -> Union[bool, str]:
    """``False`` / ``None`` -> False; ``True`` -> "tensorwise"; a recipe name as it is; else ValueError."""
    if value is None or value is False:
        return False
    if value is True:
        return "tensorwise"
    if isinstance(value, str) and value in FP8_RECIPES:
        return value
    raise ValueError(f"fp8 must be False, True (= 'tensorwise') or one of {FP8_RECIPES}, got {value!r}")


class TorchaoImportNoise(logging.Filter):
    """Drops two kinds of message torchao's import logs that a user cannot act on; passes everything else.

    - ``Failed to load .../torchao/_C_mxfp8...so`` / ``_C_cutlass_90a...so``: torchao's optional MX-FP8 and
      CUTLASS (sm90a) extensions, which load only on the CUDA build and Python they were built for. The pack
      runs neither (its FP8 matmuls are ``torch._scaled_mm`` and its own kernels), so nothing is lost.
    - torch's notice that registering an Enum as a pytree constant is deprecated, for torchao's own Enums
      (``KernelPreference``): torchao's to change.
    """

    _LOADER = re.compile(r"Failed to load \S*torchao[\\/]_C_(mxfp8|cutlass)\w*\.[\w.-]*so\b")
    _ENUM_CONSTANT = "is an Enum subclass and is now natively supported"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            try:
                return self._LOADER.match(record.getMessage()) is None
            except Exception:  # a record whose arguments do not format is not ours to judge
                return True
        if record.name == "torch.utils._pytree" and self._ENUM_CONSTANT in str(record.msg):
            cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
            ours = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.split(".")[0] == "torchao"
            return not ours
        return True


def _filter_torchao_import_noise() -> None:
    """Attach :class:`TorchaoImportNoise` (once) to the loggers torchao's import writes through: ``torchao``
    and ``torch.utils._pytree`` (a logger's filter sees only the records logged to that logger)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, TorchaoImportNoise) for f in logger.filters):
            logger.addFilter(TorchaoImportNoise())


def require_torchao() -> Any:
    """``torchao.float8``, or an ImportError saying which extra installs it."""
    _filter_torchao_import_noise()
    try:
        import torchao
        import torchao.float8 as float8
    except ImportError as err:
        raise ImportError("FP8 linears need torchao: pip install 'lightning-perf[fp8]' (or pip install torchao)") from err
    version = tuple(int(p) for p in torchao.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < _TORCHAO_MIN:
        raise ImportError(f"FP8 linears need torchao >= {'.'.join(map(str, _TORCHAO_MIN))}, found {torchao.__version__}")
    return float8


def require_fp8(recipe: Union[bool, str]) -> None:
    """Raise ImportError now, naming the extra, if ``recipe`` cannot run here (torchao; Triton for "delayed")."""
    recipe = normalize_fp8(recipe)
    if recipe:
        require_torchao()
    if recipe == "delayed":
        _require_pack("fp8='delayed'")


def fp8_linear_config(recipe: str, *, fsdp_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` ("tensorwise" | "rowwise" | "delayed": tensorwise's,
    the layer class adds the history).

    ``fsdp_all_gather`` (tensorwise only) makes FSDP2 all-gather the weights in FP8.
    """
    float8 = require_torchao()
    recipe = normalize_fp8(recipe)
    if not recipe:
        raise ValueError("fp8_linear_config needs a recipe name, got False")
    if fsdp_all_gather and recipe != "tensorwise":
        raise ValueError(f"FP8 all-gather needs the 'tensorwise' recipe (one scale per weight); got {recipe!r}")
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise" if recipe == "delayed" else recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_all_gather)


def _fp8_shape_ok(module: nn.Module) -> bool:
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def convert_to_fp8(module: nn.Module, recipe: Union[bool, str], *,
                   include: Optional[Callable[[nn.Module, str], bool]] = None,
                   amax_history: int = _AMAX_HISTORY) -> list[str]:
    """Swap ``module``'s ``nn.Linear`` layers for torchao ``Float8Linear`` in place; returns their names.

    Layers whose width or height is not a multiple of 16 stay as they are (FP8 matmuls cannot
    take them), as does any layer ``include(layer, name)`` rejects. Works on the ``meta`` device
    (nothing is allocated; the parameters are the same objects). ``amax_history``: with "delayed",
    how many steps of amax each scale is taken over.
    """
    recipe = normalize_fp8(recipe)
    if not recipe:
        return []
    float8 = require_torchao()
    if recipe == "delayed":
        _require_pack("fp8='delayed'")
        if isinstance(amax_history, bool) or not isinstance(amax_history, int) or amax_history < 1:
            raise ValueError(f"amax_history must be a positive number of steps, got {amax_history!r}")
    config = fp8_linear_config(recipe)
    converted: list[str] = []

    def keep(layer: nn.Module, name: str) -> bool:
        take = isinstance(layer, nn.Linear) and _fp8_shape_ok(layer) and (include is None or include(layer, name))
        if take:
            converted.append(name)
        return take

    float8.convert_to_float8_training(module, module_filter_fn=keep, config=config)
    if recipe == "rowwise":
        return converted
    for name in converted:
        layer = module.get_submodule(name) if name else module
        layer.__class__ = _tensorwise_class() if recipe == "tensorwise" else _delayed_class()
        if recipe == "delayed":
            history = torch.zeros(3, amax_history, dtype=torch.float32, device=layer.weight.device)
            layer.register_buffer("fp8_amax_history", history, persistent=False)
            layer.register_load_state_dict_pre_hook(_empty_history_on_load)
    return converted


def _require_pack(what: str) -> None:
    """Import the pack's FP8 matmul and fused MLP (once, outside any traced code), or an ImportError
    naming the extra."""
    try:
        importlib.import_module(_PACK)
        importlib.import_module(_PACK_MLP)
    except ModuleNotFoundError as err:
        if err.name != "triton":
            raise
        raise ImportError(f"{what} runs the pack's FP8 matmul, which needs Triton: pip install "
                          "'lightning-perf[triton]' (Linux), or use fp8='tensorwise'") from err


def _empty_history_on_load(module: nn.Module, *args: Any) -> None:
    """Loading a state dict empties the layer's amax history (the weights it recorded are gone)."""
    with torch.no_grad():
        module.fp8_amax_history.zero_()


def reset_amax_history(module: nn.Module) -> int:
    """Empty the amax history of every delayed FP8 layer in ``module`` (the next call of each falls back
    to the current amax); returns how many layers were reset."""
    count = 0
    with torch.no_grad():
        for sub in module.modules():
            if fp8_recipe_of(sub) == "delayed":
                sub.fp8_amax_history.zero_()
                count += 1
    return count


def uses_delayed_fp8(module: nn.Module) -> bool:
    """Whether ``module`` has delayed FP8 layers or will build them (its ``config.fp8`` is "delayed",
    for a module that builds its network later, as ``GPTLightningModule`` does)."""
    if getattr(getattr(module, "config", None), "fp8", None) == "delayed":
        return True
    return any(fp8_recipe_of(sub) == "delayed" for sub in module.modules())


@functools.lru_cache(maxsize=None)
def _tensorwise_class() -> type:
    """torchao's ``Float8Linear`` with the pack's tensorwise matmul for plain weights (see the module docstring)."""
    from torchao.float8.float8_linear import Float8Linear

    try:  # once, outside any traced code; without Triton every call takes torchao's path
        importlib.import_module(_PACK)
        importlib.import_module(_PACK_MLP)
    except ImportError:
        pass

    class TensorwiseFloat8Linear(Float8Linear):
        """A tensorwise torchao ``Float8Linear``; a plain weight takes ``kernels.ops.fp8_linear``."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if _pack_path(input, self.weight):
                return sys.modules[_PACK].fp8_linear(input, self.weight, self.bias)
            return super().forward(input)

    TensorwiseFloat8Linear.__module__ = __name__
    TensorwiseFloat8Linear.__qualname__ = "TensorwiseFloat8Linear"  # pickles by name (module __getattr__)
    return TensorwiseFloat8Linear


@functools.lru_cache(maxsize=None)
def _delayed_class() -> type:
    """The tensorwise layer with delayed scaling: the pack's matmul with the layer's amax history."""

    class DelayedFloat8Linear(_tensorwise_class()):
        """A tensorwise FP8 linear whose scales come from ``fp8_amax_history`` (3, H): the last H amaxes of
        its input, weight and output gradient, recorded by the casts themselves (see ``kernels.torchao_fp8``)."""

        _lp_fp8_recipe = "delayed"

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return _delayed_matmul(input, self.weight, self, self.bias)

        def reset_parameters(self) -> None:
            super().reset_parameters()
            history = getattr(self, "fp8_amax_history", None)  # None while nn.Linear.__init__ runs
            if history is not None:
                with torch.no_grad():
                    history.zero_()

    DelayedFloat8Linear.__module__ = __name__
    DelayedFloat8Linear.__qualname__ = "DelayedFloat8Linear"
    return DelayedFloat8Linear


def _delayed_matmul(x: torch.Tensor, weight: torch.Tensor, layer: nn.Module,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in FP8 with ``layer``'s amax history, recorded while it trains."""
    if type(weight) not in (torch.Tensor, nn.Parameter) or type(x) is not torch.Tensor:
        raise ValueError(
            f"fp8='delayed' keeps an amax history for plain weights; this layer got a {type(weight).__name__} weight "
            f"and a {type(x).__name__} input (tensor parallelism or FSDP2 make DTensors, FP8 all-gather makes FP8 "
            "weights): use fp8='tensorwise' there")
    return sys.modules[_PACK].fp8_linear(x, weight, bias, amax_history=layer.fp8_amax_history, record=layer.training)


def delayed_gelu_mlp(x: torch.Tensor, up: nn.Module, down: nn.Module) -> Optional[torch.Tensor]:
    """``down(gelu_tanh(up(x)))`` for two delayed FP8 layers, fused: the GELU and the FP8 casts of its
    output (forward) and of its input gradient (backward) in one pass each (``fp8_gelu_mlp`` in
    ``kernels.ops.fp8_gelu_mlp``), the same matmuls and histories as the layers' own forward.

    None where that does not apply (another recipe, DTensor or FP8-gathered weights, no Triton): the
    caller runs the layers, which compute the same function unfused (or refuse, as they do).
    """
    if fp8_recipe_of(up) != "delayed" or fp8_recipe_of(down) != "delayed":
        return None
    if type(x) is not torch.Tensor or any(type(w) not in (torch.Tensor, nn.Parameter) for w in (up.weight, down.weight)):
        return None
    return sys.modules[_PACK_MLP].fp8_gelu_mlp(x, up.weight, up.bias, down.weight, down.bias,
                                               up_history=up.fp8_amax_history,
                                               down_history=down.fp8_amax_history, record=up.training)


def __getattr__(name: str) -> Any:
    if name == "TensorwiseFloat8Linear":  # defined once torchao is imported
        return _tensorwise_class()
    if name == "DelayedFloat8Linear":
        return _delayed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _pack_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the pack's tensorwise matmul takes (x, weight): plain tensors it supports, Triton installed.

    Modules are read from ``sys.modules`` (imported when a layer was converted), so the forward
    neither imports nor retries a failed import on every call.
    """
    if type(weight) not in (torch.Tensor, nn.Parameter) or type(x) is not torch.Tensor:
        return False
    ops = sys.modules.get(_PACK)
    return ops is not None and ops.fp8_linear_supported(x, weight)


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` (False when torchao was never imported: then
    nothing can be one)."""
    ao = sys.modules.get("torchao.float8.float8_linear")
    return ao is not None and isinstance(module, ao.Float8Linear)


def fp8_recipe_of(module: nn.Module) -> Optional[str]:
    """"tensorwise" / "rowwise" / "delayed" for a torchao ``Float8Linear`` (by its weight's scaling
    granularity; "delayed" for the layers that keep an amax history)."""
    if not is_fp8_linear(module):
        return None
    if getattr(type(module), "_lp_fp8_recipe", None) == "delayed":  # no class lookup: traced code calls this
        return "delayed"
    granularity = module.config.cast_config_weight.scaling_granularity
    return "tensorwise" if granularity.name == "TENSORWISE" else "rowwise"


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, like: nn.Module) -> torch.Tensor:
    """``x @ weight.T`` as the FP8 linear ``like`` computes it (its recipe, both gradients in FP8).

    For a weight that is not ``like``'s own, e.g. the q, k and v weights concatenated by rows:
    one FP8 cast of ``x`` and one matmul instead of three. With a delayed ``like``, ``weight`` is recorded
    in ``like``'s history (the concatenation's amax, every call alike).
    """
    recipe = fp8_recipe_of(like)
    if recipe == "delayed":
        return _delayed_matmul(x, weight, like)
    if recipe == "tensorwise" and _pack_path(x, weight):
        return sys.modules[_PACK].fp8_linear(x, weight)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), like.linear_mm_config, like.config)


def check_fp8_device(device: torch.device) -> None:
    """Raise ValueError when FP8 matmuls cannot run on ``device`` (CUDA before compute capability 8.9)."""
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"FP8 linears need a GPU of compute capability >= 8.9 (Ada, Hopper or later); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}: set fp8=False")


def _quantized(t: torch.Tensor, rowwise: bool, history: Optional[torch.Tensor] = None) -> torch.Tensor:
    """t rounded to e4m3 and dequantised: one scale per tensor, or per row along the last dim rounded
    down to a power of two (torchao's recipes); ``history`` (H,): the tensor's scale from its recorded
    amaxes (its own amax while they are all zeros), values beyond saturating."""
    e4m3 = torch.float8_e4m3fn
    fmax = torch.finfo(e4m3).max
    t = t.float()
    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()
    if history is not None and bool(history.amax() > 0):
        amax = history.amax().float()
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).clamp(-fmax, fmax).to(e4m3).float() / scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                         recipe: str = "tensorwise", amax_history: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The forward of an FP8 linear in plain PyTorch: e4m3 operands with dynamic scales fmax / amax,
    per tensor ("tensorwise") or per row of x and of W along the contracted dimension, rounded down to
    a power of two ("rowwise"), multiplied in fp32 (rowwise: the product rounded to bf16, as the
    row-scaled FP8 matmul writes it); returns x's dtype. "delayed": per tensor, x and W scaled by
    fmax / max of rows 0 and 1 of ``amax_history`` (a delayed layer's ``fp8_amax_history`` before the
    call), as "tensorwise" where a row is all zeros or no history is given."""
    recipe = normalize_fp8(recipe)
    rowwise = recipe == "rowwise"
    hx, hw = (amax_history[0], amax_history[1]) if recipe == "delayed" and amax_history is not None else (None, None)
    y = _quantized(x, rowwise, hx) @ _quantized(weight, rowwise, hw).t()
    if rowwise:
        y = y.to(torch.bfloat16).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
