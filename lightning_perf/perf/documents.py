"""Attention FLOPs of packed documents: causal attention counted per document.

A packed row of T tokens holds several documents, and document-causal attention lets token i see
token j only inside its own document (``j <= i``). The model-FLOP convention for one causal
sequence of T tokens is ``A(T)`` attention FLOPs per token (``6 * L * d * T`` for the GPT: the
score and value matmuls over the causal half of the square, forward and backward), linear in T, so
the sequence does ``T * A(T) = a * T**2`` with ``a = A(T) / T``. Applied to each document of length
``L_i`` instead of to the row:

    attention FLOPs of a row = sum_i L_i * A(L_i) = a * sum_i L_i**2

A row of 8 documents of T/8 tokens does 1/8 of the work of one causal sequence of T tokens. Forward
and backward split as the rest of the model FLOPs do (backward = 2 x forward).

The sum of squared lengths is what a batch's attention costs; :func:`document_work` computes it
where ``doc_ids`` lives, with no host-device sync, and :class:`DocumentWorkReader` brings it to the
host through pinned memory, to be read once the step it belongs to has completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "AttentionFlops",
    "DocumentWork",
    "DocumentWorkReader",
    "document_attention_flops",
    "document_lengths",
    "document_work",
    "packed_batch_flops",
]


def document_lengths(doc_ids: torch.Tensor) -> list[list[int]]:
    """Token count of each document of each row of ``doc_ids`` (B, T), in order of first appearance.

    Reads the values: for host tensors and tests. Equal ids need not be adjacent (the mask is
    ``doc_ids[i] == doc_ids[j] and j <= i``), so a document is every token of one id."""
    out = []
    for row in doc_ids.reshape(doc_ids.shape[0], -1).tolist():
        counts: dict[int, int] = {}
        for i in row:
            counts[i] = counts.get(i, 0) + 1
        out.append(list(counts.values()))
    return out


@dataclass(frozen=True, kw_only=True)
class AttentionFlops:
    """Model attention FLOPs of a batch, forward and backward (backward = 2 x forward)."""

    forward: float
    backward: float

    @property
    def model(self) -> float:
        return self.forward + self.backward


def document_attention_flops(lengths: Iterable[int], *,
                             attention_flops_per_token: Callable[[int], float]) -> AttentionFlops:
    """``sum_i L_i * A(L_i)`` over documents of ``lengths``: each one counted as one causal sequence of
    its length, ``A(L)`` being the model's attention FLOPs per token of such a sequence (forward +
    backward, e.g. ``GPTConfig.attention_flops_per_token``)."""
    total = 0.0
    for n in lengths:
        if n < 0:
            raise ValueError(f"document lengths must be >= 0, got {n}")
        if n:
            total += n * float(attention_flops_per_token(n))
    return AttentionFlops(forward=total / 3, backward=2 * total / 3)


def document_work(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[sum of squared document lengths, number of documents]`` (int64, 2) over the rows of
    ``doc_ids`` (B, T), on its device: fixed-shape ops only, so nothing waits for the device."""
    ids = doc_ids.reshape(doc_ids.shape[0], -1)
    ids = ids.sort(dim=1).values  # the tokens of one id side by side, wherever they sit in the row
    B, T = ids.shape
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run = new.to(torch.int64).cumsum(dim=1) - 1  # (B, T) index of each token's document in its row
    lengths = torch.zeros(B, T, dtype=torch.int64, device=ids.device).scatter_add_(1, run, torch.ones_like(run))
    return torch.stack([(lengths * lengths).sum(), new.sum()])


@dataclass(frozen=True, kw_only=True)
class DocumentWork:
    """A packed batch's attention work: ``square_sum`` = sum of squared document lengths over its rows."""

    square_sum: int
    documents: int


class DocumentWorkReader:
    """:func:`document_work` of a batch, read on the host without waiting for the device.

    ``issue(doc_ids)`` queues the computation on the current stream and, on an accelerator, a
    non-blocking copy into a pinned host buffer; ``read(handle)`` reads that buffer. Read a handle
    only once work queued after ``issue`` on the same stream has completed (the step's closing
    timing event, as ``StepTimer.poll`` returns it): the copy is then done. Buffers are recycled.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def issue(self, doc_ids: torch.Tensor) -> torch.Tensor:
        work = document_work(doc_ids)
        if work.device.type == "cpu":
            return work
        buf = self._free.pop() if self._free else torch.empty(2, dtype=torch.int64, pin_memory=True)
        buf.copy_(work, non_blocking=True)
        return buf

    def read(self, handle: torch.Tensor, *, release: bool = True) -> DocumentWork:
        # a host buffer read through numpy: never a device read, whatever a sync detector assumes of host tensors
        square_sum, documents = (int(x) for x in handle.numpy())
        if release and handle.is_pinned() and len(self._free) < 64:
            self._free.append(handle)
        return DocumentWork(square_sum=square_sum, documents=documents)


def packed_batch_flops(*, tokens: int, seq_len: int, flops_per_token: float, attention_flops_per_token: float,
                       square_sum: float) -> float:
    """Model FLOPs of a packed batch of ``tokens`` in rows of ``seq_len``: ``flops_per_token`` of one
    causal sequence of ``seq_len`` (of which ``attention_flops_per_token`` = ``A(T)`` is attention)
    for every token, with attention replaced by its per-document count ``A(T) / T * square_sum``."""
    if seq_len < 1 or tokens < 0 or square_sum < 0:
        raise ValueError(f"seq_len ({seq_len}) must be >= 1, tokens ({tokens}) and square_sum ({square_sum}) >= 0")
    dense = flops_per_token - attention_flops_per_token
    return dense * tokens + attention_flops_per_token / seq_len * square_sum
