"""Checks of the data shape against the model and the layout, with numbers only.

The layout (:class:`~lightning_perf.parallel.layout.dims.ParallelDims`,
:class:`~lightning_perf.parallel.model_parallel.pipeline.PipelineConfig`), the GPT config and the ZeRO
options are validated when they are built. What only shows once data arrives (a batch
the pipeline cannot cut into microbatches, a sequence longer than the model's context or
not divisible over sequence-parallel or context-parallel ranks) is checked here from the data module's
numbers, so the strategies can call it in ``setup_environment`` before the process
group exists: every rank raises the same ``ValueError`` instead of failing inside a
collective on the first batch.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_perf.parallel.model_parallel.context_parallel import check_context_parallel_seq_len
from lightning_perf.parallel.model_parallel.pipeline import PipelineConfig
from lightning_perf.parallel.model_parallel.tensor_parallel import tp_sequence_check

__all__ = ["check_data_layout", "data_shape"]


def data_shape(datamodule: Any) -> tuple[Optional[int], Optional[int]]:
    """``(per-rank batch_size, seq_len)`` of a data module that exposes them (else ``None``)."""
    if datamodule is None:
        return None, None
    out = []
    for name in ("batch_size", "seq_len"):
        value = getattr(datamodule, name, None)
        out.append(value if isinstance(value, int) and not isinstance(value, bool) else None)
    return out[0], out[1]


def check_data_layout(
    *,
    batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    model_config: Any = None,
    tensor_parallel_size: int = 1,
    sequence_parallel: Any = False,
    pipeline: Optional[PipelineConfig] = None,
    context_parallel_size: int = 1,
) -> None:
    """Raise ``ValueError`` (with the numbers) if batches of this shape cannot train.

    Args:
        batch_size: samples per batch on one data-parallel rank.
        seq_len: tokens per sample.
        model_config: anything with ``block_size`` (a ``GPTConfig``).
        tensor_parallel_size, sequence_parallel: tensor parallelism and whether it shards the sequence
            (True) or the batch (``"batch"``).
        pipeline: a ``PipelineConfig`` (its microbatches must divide the batch) or ``None``.
        context_parallel_size: context-parallel ranks (the sequence is cut into ``2 * cp`` chunks).
    """
    tp, cp = tensor_parallel_size, context_parallel_size
    pp = pipeline.pipeline_parallel_size if pipeline is not None else 1
    block_size = getattr(model_config, "block_size", None)
    if seq_len is not None and isinstance(block_size, int) and seq_len > block_size:
        raise ValueError(
            f"seq_len={seq_len} is longer than the model's block_size={block_size}: lower the data "
            f"module's seq_len or build the model with block_size >= {seq_len}"
        )
    if seq_len is not None and cp > 1:
        check_context_parallel_seq_len(seq_len, cp)
        if sequence_parallel is True and tp > 1 and (seq_len // cp) % tp:
            raise ValueError(
                f"each context-parallel rank holds seq_len / cp = {seq_len} / {cp} = {seq_len // cp} tokens, which "
                f"sequence parallelism splits over tp={tp}: {seq_len // cp} / {tp} = {seq_len // cp / tp:.3g}; use "
                f"a seq_len divisible by {cp * tp} (and {2 * cp}) or sequence_parallel='batch'"
            )
    if sequence_parallel == "batch":
        if batch_size is not None and tp > 1:
            m = pipeline.num_microbatches if pipeline is not None and pp > 1 else 1
            tp_sequence_check(seq_len or 0, tp, "batch", batch=batch_size, microbatches=m or 1)
    elif seq_len is not None and sequence_parallel and tp > 1 and seq_len % tp:
        raise ValueError(
            f"sequence parallelism splits seq_len={seq_len} over tp={tp} ranks: {seq_len} / {tp} = "
            f"{seq_len / tp:.3g}; use a seq_len divisible by {tp} or sequence_parallel=False"
        )
    if batch_size is not None and pipeline is not None and pp > 1:
        pipeline.check_batch(batch_size)
