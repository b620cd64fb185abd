"""Map-style token datasets. Every sample is ``(inputs, targets)``, two int64 tensors of
shape ``(seq_len,)`` cut from one window of ``seq_len + 1`` tokens::

    window  = tokens[i * seq_len : i * seq_len + seq_len + 1]
    inputs  = window[:-1]
    targets = window[1:]

Windows do not overlap (stride ``seq_len``; only the boundary token is shared), so
sample ``i`` is a pure function of ``i``: shuffling and resuming only need indices.
With packed documents (``documents=DocumentBoundaries(...)``) a sample is
``(inputs, targets, doc_ids)`` from the same window (see ``documents.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_perf.data.documents import DocumentBoundaries

__all__ = ["SyntheticTokenDataset", "TokenWindowDataset"]


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class TokenWindowDataset(Dataset):
    """Non-overlapping ``seq_len + 1`` windows over a 1-D token array.

    ``tokens`` may be a ``numpy.memmap`` (nothing is read until a sample is asked
    for, so many-GB files cost no memory) or any 1-D integer array.

    Args:
        tokens: 1-D array of token ids.
        seq_len: tokens per sample.
        name: shown in error messages (for a file, its path).
        vocab_size: if given, every sample is checked to hold ids below it (one ``max``
            per sample), so a corrupted file fails with its name and the sample index
            instead of an out-of-range embedding lookup on the device.
        documents: packed documents: samples are ``(inputs, targets, doc_ids)``, the targets
            that cross a document boundary ignored unless it says otherwise.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        name: str = "tokens",
        vocab_size: int | None = None,
        documents: DocumentBoundaries | None = None,
    ) -> None:
        _check_positive("seq_len", seq_len)
        if tokens.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D token array, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name
        self.vocab_size = vocab_size
        self.documents = documents
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def window(self, index: int) -> np.ndarray:
        """The raw ``seq_len + 1`` tokens of sample ``index`` (as stored)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.name} with {self.num_samples} samples")
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        if self.vocab_size is not None and window.size and int(window.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.name}: sample {index} (tokens {start}..{start + self.seq_len}) holds id {int(window.max())}"
                f" >= vocab_size {self.vocab_size}; the file is corrupted or its metadata is wrong"
            )
        return window

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        window = self.window(int(index))
        if self.documents is not None:
            return self.documents.sample(window)
        w = torch.from_numpy(window.astype(np.int64))
        return w[:-1], w[1:]

    def __repr__(self) -> str:
        packed = ", packed documents" if self.documents is not None else ""
        return (f"{type(self).__name__}({self.name}, tokens={len(self.tokens)}, seq_len={self.seq_len},"
                f" samples={len(self)}{packed})")


class SyntheticTokenDataset(Dataset):
    """Uniform random tokens in ``[0, vocab_size)``, generated per index.

    Sample ``i`` is drawn from a generator seeded with ``(seed, stream, i)``: the same
    index always gives the same sample, in any process or worker, and nothing is held
    in memory. Different ``stream`` values (train = 0, val = 1) give independent data.

    Args:
        vocab_size: tokens are drawn from ``[0, vocab_size)``.
        seq_len: tokens per sample.
        num_samples: length of the dataset.
        seed: base seed.
        stream: sub-stream id, so train and val differ under one seed.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, *, seed: int = 0, stream: int = 0) -> None:
        _check_positive("vocab_size", vocab_size)
        _check_positive("seq_len", seq_len)
        _check_positive("num_samples", num_samples)
        if seed < 0 or stream < 0:
            raise ValueError(f"seed and stream must be >= 0, got seed={seed}, stream={stream}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.seed = seed
        self.stream = stream

    def __len__(self) -> int:
        return self.num_samples

    def window(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} synthetic samples")
        rng = np.random.default_rng([self.seed, self.stream, index])
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self.window(int(index)))
        return w[:-1], w[1:]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, seq_len={self.seq_len},"
            f" samples={self.num_samples}, seed={self.seed}, stream={self.stream})"
        )
