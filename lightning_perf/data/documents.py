"""Packed documents: where the documents of a token window start, and which targets cross them.

Token files and the built-in corpus hold every document as ``<bos> tokens <eos>``, back to back. A
window of ``seq_len + 1`` tokens therefore holds the end of one document, whole documents, and the
start of another. A new document starts at position t > 0 of the window when the token before it
is ``<eos>`` or the token itself is ``<bos>`` (in the standard layout both mark the same place; one
suffices for a stream written with only one of them). Numbering them from 0 gives ``doc_ids``,
non-decreasing along the window: the form the model's document-causal attention takes
(``lightning_perf.kernels.document_mask``)::

    window   <bos> a  b  <eos> <bos> c  d  <eos> <bos> e   (seq_len = 9, plus one target token)
    inputs   <bos> a  b  <eos> <bos> c  d  <eos> <bos>
    doc_ids    0   0  0    0     1   1  1    1     2
    targets    a   b <eos> -100  c   d <eos> -100  e

The target of a document's last token is the first token of the next document: unrelated, so it
is ``ignore_index`` unless ``cross_document_targets``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

__all__ = ["DocumentBoundaries"]


@dataclass(frozen=True, kw_only=True)
class DocumentBoundaries:
    """Document ids and loss targets of a packed window.

    Args:
        eos_id: the tokenizer's end-of-document id; a document starts after it.
        bos_id: the tokenizer's start-of-document id (a document starts at it), or None.
        cross_document_targets: keep the target of each document's last token (the next document's
            first token) instead of replacing it with ``ignore_index``.
        ignore_index: the target the loss skips (``F.cross_entropy``'s default).
    """

    eos_id: int
    bos_id: Optional[int] = None
    cross_document_targets: bool = False
    ignore_index: int = -100

    def __post_init__(self) -> None:
        for name in ("eos_id", "bos_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a token id >= 0, got {value!r}")

    def starts(self, window: np.ndarray) -> np.ndarray:
        """Bool (len(window),): True where a document starts after position 0."""
        starts = np.zeros(len(window), dtype=bool)
        starts[1:] = window[:-1] == self.eos_id
        if self.bos_id is not None:
            starts[1:] |= window[1:] == self.bos_id
        return starts

    def sample(self, window: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(inputs, targets, doc_ids)`` of a ``seq_len + 1`` window: int64, int64, int32, each (seq_len,)."""
        w = torch.from_numpy(np.asarray(window).astype(np.int64))
        starts = self.starts(window)
        doc_ids = torch.from_numpy(np.cumsum(starts[:-1], dtype=np.int32))
        targets = w[1:].clone()
        if not self.cross_document_targets:
            targets[torch.from_numpy(starts[1:])] = self.ignore_index
        return w[:-1], targets, doc_ids
