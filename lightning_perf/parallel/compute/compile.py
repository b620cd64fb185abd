"""torch.compile per block, and under tensor parallelism per block with its TP hooks.

Eager DTensor dispatch costs host time on every op (the GPU idles between small
launches), so tensor parallelism wants compiled blocks. A compiled region must not begin
with ``DTensor.from_local`` of a plain-tensor graph input: the sequence-parallel norm does
exactly that with the residual stream, and AOTAutograd then hands the embedding's
redistribution a plain gradient in backward (an ``AttributeError: '_local_tensor'``). So
under TP each block is compiled together with its submodules' forward hooks (the module
call itself is traced: :func:`compile_blocks`), and a checkpointed block under TP compiles
its attention / MLP sublayers (:func:`compile_targets`). Without TP a block is compiled
with ``nn.Module.compile``.

Every function here leaves parameter names and the state dict unchanged.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_perf.parallel.compute.activation_checkpointing import checkpointing_mode

__all__ = [
    "COMPILE_MODES",
    "COMPILE_SCOPES",
    "TP_OVERLAP_MODES",
    "apply_compile",
    "compile_blocks",
    "compile_head_loss",
    "compile_targets",
    "inductor_overlap_options",
    "tp_sublayers",
]

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# what a LightningModule compiles: each block, or the whole model as one graph
COMPILE_SCOPES = ("block", "model")
# how Inductor may overlap a compiled TP block's collectives with its compute: see inductor_overlap_options
TP_OVERLAP_MODES = ("none", "reorder", "reorder_peak_memory", "schedule")


def apply_compile(modules: list[nn.Module], mode: Optional[str], *, fullgraph: bool = False) -> None:
    """``torch.compile`` each module in place (``nn.Module.compile``: names and state dict unchanged).

    Pass the blocks for per-block compilation (compile time flat in depth: one graph reused by
    every block; composes with FSDP2 wrapping per block), or ``[model]`` for one graph of the
    whole model (fewer launches and guard checks per step: the better choice for small models
    on one GPU, where the host, not the GPU, sets the pace).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r} is not one of {COMPILE_MODES}")
    if mode is None:
        return
    for module in modules:
        module.compile(mode=None if mode == "default" else mode, fullgraph=fullgraph)


def compile_targets(block: nn.Module, *, tensor_parallel: bool) -> list[nn.Module]:
    """What to compile in ``block``: the whole block, or under TP with activation checkpointing its sublayers.

    Under TP the block is compiled with every submodule's hooks inside (see :func:`compile_blocks`):
    compiling only the attention / MLP sublayers would leave the sequence-parallel norms and the
    residual adds to eager DTensor / ATen kernels, which is slower.
    A checkpointed block under TP keeps the sublayer scope: Dynamo tracing the checkpoint together
    with the DTensor redistributions inside it fails (AOTAutograd finds DTensors among the tensors
    it saves for the recomputation), while compiled sublayers inside an eager checkpoint are exact.
    """
    if tensor_parallel and checkpointing_mode(block) is not None:
        return tp_sublayers(block)
    return [block]


def tp_sublayers(block: nn.Module) -> list[nn.Module]:
    """The attention / MLP sublayers of ``block`` (children owning matrices): the narrower TP compile scope."""
    subs = [c for c in block.children() if any(p.dim() >= 2 for p in c.parameters())]
    return subs or [block]


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # traced by Dynamo as one frame: the hooks of the module and its submodules (the TP styles'
    # all-gather / reduce-scatter, sequence-parallel norms) are inlined into the same graph as the
    # matmuls; the module is an input, so every block shares a single compiled graph
    return module._call_impl(*args, **kwargs)


def _call_module_split(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    # two independent halves of the batch through the same module in one traced graph: the
    # scheduler can run one half's TP collectives while the other half computes (forward and
    # backward); per-token and per-sequence maths make the halves exact pieces of the whole
    outs = [module._call_impl(part, *args, **kwargs) for part in x.chunk(2, dim=0)]
    return torch.cat(outs, dim=0)


def _splittable(x: Any, parts: int) -> bool:
    from torch.distributed.tensor import DTensor

    # a DTensor input (the batch-sharded first block with a position table) is left whole: chunking
    # its sharded batch dimension would redistribute it
    return (isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() >= 1
            and x.shape[0] >= parts and x.shape[0] % parts == 0)


def _run_hooked_split(whole: Any, split: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    chosen = split if args and _splittable(args[0], 2) else whole
    return _run_hooked(chosen, module, *args, **kwargs)


def _run_hooked(compiled: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A graph input that is a view, e.g. the output of DTensor.to_local() (the vocab-parallel embedding
    # feeding the first block directly), gets a wrong gradient or a plain tensor where DTensor's
    # backward expects a DTensor (torch 2.11-2.13, aot_eager and inductor alike); a copy, made only
    # for such inputs that need a gradient (one (B, T/tp, d) tensor per step; sliced RoPE tables
    # pass as they are), gives the graph an input of its own
    args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad and a._is_view() else a
                 for a in args)
    return compiled(module, *args, **kwargs)


_HOOKED_COMPILES: dict[tuple[str, str, str, bool], Any] = {}

# Inductor scheduler passes, in order, per tp_overlap mode
_REORDER_PASSES = {
    # waits as late as their first user, collectives as early as their inputs, then independent
    # compute (the weight-gradient matmuls) moved between a collective and its wait
    "reorder": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
    # torch's recommended list: collectives moved early only where the graph's peak memory allows
    "reorder_peak_memory": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def inductor_overlap_options(tp_overlap: str, device_type: str) -> dict[str, Any]:
    """``torch.compile(options=...)`` that let Inductor overlap a TP block's collectives with its compute.

    Within a compiled block the backward's weight-gradient matmuls depend on no collective, so
    the reduce-scatter of the input gradient and the next sublayer's all-gather can run under
    them; by default Inductor waits on each collective right where it is issued. ``"reorder"`` and
    ``"reorder_peak_memory"``: the scheduler passes above (any device); ``"schedule"``: the
    runtime-estimated overlap scheduler on the ATen graph (CUDA only: it times ops on the GPU;
    ``"reorder"`` elsewhere).
    """
    if tp_overlap == "none":
        return {}
    if tp_overlap == "schedule":
        if device_type == "cuda":
            return {"aten_distributed_optimizations.enable_overlap_scheduling": True}
        tp_overlap = "reorder"
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": list(_REORDER_PASSES[tp_overlap])}


def _hooked_compile(mode: str, backend: str, tp_overlap: str = "none", device_type: str = "cpu",
                    split: bool = False) -> Any:
    options = inductor_overlap_options(tp_overlap, device_type) if backend == "inductor" else {}
    key = (mode, backend, repr(sorted(options.items())), split)
    fn = _call_module_split if split else _call_module
    if key not in _HOOKED_COMPILES:
        if backend == "inductor":
            # mode and options are exclusive in torch.compile: a mode's own options join ours
            if mode != "default":
                from torch._inductor import list_mode_options

                options = {**list_mode_options(mode), **options}
            _HOOKED_COMPILES[key] = torch.compile(fn, options=options or None)
        else:
            _HOOKED_COMPILES[key] = torch.compile(fn, backend=backend)
    return _HOOKED_COMPILES[key]


def compile_blocks(blocks: list[nn.Module], mode: str, *, backend: str = "inductor", tensor_parallel: bool,
                   tp_overlap: str = "none", device_type: str = "cpu", tp_split: int = 1) -> None:
    """``torch.compile`` per block (names and state dict unchanged); after TP, before FSDP.

    Under TP each block is compiled together with its submodules' forward hooks, so the
    sequence-parallel norms, the all-gathers, the matmuls, the reduce-scatters and the residual
    adds land in one graph (what Inductor fuses, and what its micro-pipelined async TP rewrites);
    every block shares that graph (the module is an input, not a constant).
    """
    for block in blocks:
        for target in compile_targets(block, tensor_parallel=tensor_parallel):
            if getattr(target, "_compiled_call_impl", None) is not None:
                continue
            if tensor_parallel:
                compiled = _hooked_compile(mode, backend, tp_overlap, device_type)
                if tp_split == 2:
                    split = _hooked_compile(mode, backend, tp_overlap, device_type, split=True)
                    target._compiled_call_impl = functools.partial(_run_hooked_split, compiled, split, target)
                else:
                    target._compiled_call_impl = functools.partial(_run_hooked, compiled, target)
            elif backend == "inductor":
                target.compile(mode=None if mode == "default" else mode)
            else:  # another backend (e.g. "aot_eager" to isolate inductor): modes are inductor's
                target.compile(backend=backend)


def compile_head_loss(stage: nn.Module, mode: str, *, backend: str = "inductor") -> bool:
    """Compile the stage's ``lm_head_loss(x, targets)`` (the GPT's head matmul + cross-entropy), if it has one.

    Under TP the head is vocab-parallel and ``loss_parallel`` computes the cross-entropy from
    DTensor ops: eagerly a dozen full passes over the fp32 (tokens x vocab/tp) logits; compiled,
    Inductor fuses them around the two small all-reduces (row max and sum). Without TP it
    fuses the logits' cast into the loss. True if compiled (a stage without the head: False).
    """
    fn = getattr(stage, "lm_head_loss", None)
    if not callable(fn) or getattr(stage, "norm", None) is None or stage in _HEAD_LOSS_COMPILED:
        return False
    if backend == "inductor":
        compiled = torch.compile(fn, mode=None if mode == "default" else mode)
    else:
        compiled = torch.compile(fn, backend=backend)
    stage.lm_head_loss = compiled
    _HEAD_LOSS_COMPILED.add(stage)
    return True


# stages whose lm_head_loss compile_head_loss replaced (compiled once, whoever asks again)
_HEAD_LOSS_COMPILED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
