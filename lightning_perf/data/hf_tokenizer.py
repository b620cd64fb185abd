"""A Hugging Face ``tokenizer.json`` tokenizer (the ``tokenizers`` library, offline), with the
:class:`~lightning_perf.data.ByteTokenizer`'s interface so ``prepare`` and ``generate`` take either.

The tokenizer is named by its folder and identified by a hash of ``tokenizer.json``: token files
record both (and the vocabulary size), and a model imported from a Hugging Face folder holding the
same ``tokenizer.json`` is checked against them (see ``TokenDataModule.setup``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

__all__ = ["HFTokenizer", "tokenizer_hash", "load_tokenizer"]

# the first of these a tokenizer knows is its begin / end of document token
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")


def tokenizer_hash(path: Union[str, Path]) -> str:
    """First 16 hex digits of the SHA-256 of ``tokenizer.json`` in folder ``path`` (or of that file)."""
    file = Path(path)
    file = file / "tokenizer.json" if file.is_dir() else file
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError("a tokenizer.json tokenizer needs tokenizers: pip install 'lightning-perf[hf]'") from err
    return tokenizers


class HFTokenizer:
    """``tokenizer.json`` in folder ``path`` (a file path works too).

    ``bos_id`` / ``eos_id`` come from ``tokenizer_config.json``'s ``bos_token`` / ``eos_token`` when the
    folder has one, else from the usual special-token names; either may be ``None``.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        tokenizers = _require_tokenizers()
        given = Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        if not file.is_file():
            raise FileNotFoundError(f"{given} holds no tokenizer.json")
        self.path = file
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        self.hash = tokenizer_hash(file)
        self.name = f"tokenizer.json:{file.parent.name}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = self._special_tokens(file.parent / "tokenizer_config.json")
        self.bos_id = self._first_id([special.get("bos_token"), *_BOS_NAMES])
        self.eos_id = self._first_id([special.get("eos_token"), *_EOS_NAMES])

    @staticmethod
    def _special_tokens(config: Path) -> dict[str, Optional[str]]:
        if not config.is_file():
            return {}
        raw = json.loads(config.read_text())
        out = {}
        for key in ("bos_token", "eos_token"):
            value = raw.get(key)
            out[key] = value.get("content") if isinstance(value, dict) else value
        return out

    def _first_id(self, names: Iterable[Optional[str]]) -> Optional[int]:
        for name in names:
            if name is not None and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        return None

    def encode(
        self, text: Union[str, bytes], *, bos: bool = False, eos: bool = False, as_numpy: bool = False
    ) -> Union[list[int], np.ndarray]:
        """Ids of ``text`` (``bytes`` are decoded as UTF-8, invalid bytes replaced), with the begin / end
        token around it when asked and the tokenizer has one; ``as_numpy`` gives an int64 array."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return np.asarray(ids, dtype=np.int64) if as_numpy else list(ids)

    def decode(self, ids: Union[Iterable[int], np.ndarray]) -> str:
        """Text of ``ids``, special tokens skipped."""
        seq = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._tok.decode([int(i) for i in seq], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path.parent)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: Union[str, Path, None]) -> Any:
    """``"byte"`` / ``None``: the byte tokenizer; a folder holding ``tokenizer.json`` (or the file): an
    :class:`HFTokenizer`."""
    from lightning_perf.data.tokenizer import ByteTokenizer

    if spec is None or str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"unknown tokenizer {spec!r}: give 'byte' or a folder holding tokenizer.json (no such folder)")
    return HFTokenizer(path)
