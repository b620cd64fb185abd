"""Byte-level tokenizer: every UTF-8 byte is a token, plus four special tokens.

No vocabulary file and no download: ids 0-255 are the bytes themselves, so any
text (and any binary file) round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

import numpy as np

__all__ = ["TOKENIZERS", "ByteTokenizer"]


class ByteTokenizer:
    """Bytes 0-255 plus ``<bos>`` = 256, ``<eos>`` = 257, ``<pad>`` = 258, ``<unk>`` = 259.

    ``vocab_size`` is 260. ``<unk>`` is never produced by :meth:`encode` (every byte
    has an id); it is kept as a spare id so the layout matches tokenizers that have one.

    Example::

        tok = ByteTokenizer()
        ids = tok.encode("héllo", eos=True)   # [104, 195, 169, 108, 108, 111, 257]
        tok.decode(ids)                        # "héllo"
    """

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    unk_id = 259
    vocab_size = 260
    special_tokens = {"<bos>": 256, "<eos>": 257, "<pad>": 258, "<unk>": 259}

    @overload
    def encode(self, text: str | bytes, *, bos: bool = ..., eos: bool = ..., as_numpy: bool = False) -> list[int]: ...

    @overload
    def encode(self, text: str | bytes, *, bos: bool = ..., eos: bool = ..., as_numpy: bool = True) -> np.ndarray: ...

    def encode(
        self, text: str | bytes, *, bos: bool = False, eos: bool = False, as_numpy: bool = False
    ) -> list[int] | np.ndarray:
        """UTF-8 bytes of ``text`` (or ``text`` itself when it is ``bytes``) as ids.

        With ``as_numpy=True`` the result is a ``uint16`` array (no Python list per
        byte, which matters for megabytes of text).
        """
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        body = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        parts = []
        if bos:
            parts.append(np.array([self.bos_id], dtype=np.uint16))
        parts.append(body)
        if eos:
            parts.append(np.array([self.eos_id], dtype=np.uint16))
        ids = np.concatenate(parts) if len(parts) > 1 else body
        return ids if as_numpy else ids.tolist()

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of the byte ids in ``ids``; special tokens are skipped, invalid UTF-8
        is replaced with U+FFFD, ids outside ``[0, vocab_size)`` raise ``ValueError``."""
        arr = np.asarray(ids.tolist() if hasattr(ids, "tolist") else list(ids), dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = arr[(arr < 0) | (arr >= self.vocab_size)][0]
            raise ValueError(f"token id {int(bad)} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


#: tokenizers by the name a token file's metadata records (``TokenFileMeta.tokenizer``)
TOKENIZERS: dict[str, type[ByteTokenizer]] = {ByteTokenizer.name: ByteTokenizer}
