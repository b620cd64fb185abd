"""Token files: a flat ``<name>.bin`` of uint16/uint32 token ids and a ``<name>.json``
sidecar describing it::

    {"magic": "lightning_perf.tokens", "version": 1, "dtype": "uint16",
     "num_tokens": 1234567, "vocab_size": 260, "tokenizer": "byte", "max_token_id": 257,
     "tokenizer_hash": null}

``max_token_id`` (the largest id in the file, ``null`` when it is empty) lets a reader
check the ids against a vocabulary without reading the file. It is optional: a sidecar
without it is still read, and :func:`scan_max_token_id` computes it from the file.
``tokenizer_hash`` identifies a ``tokenizer.json`` tokenizer (``tokenizer`` then names its
folder); ``null`` for the byte tokenizer.

A dataset directory holds ``train.bin`` / ``train.json`` and ``val.bin`` /
``val.json`` (written by :func:`lightning_perf.data.prepare`). Files are opened with
``numpy.memmap``: only the windows that are sampled are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lightning_perf.data.datasets import TokenWindowDataset
from lightning_perf.data.documents import DocumentBoundaries

__all__ = [
    "MAGIC",
    "MemmapTokenDataset",
    "TokenFileMeta",
    "dtype_for_vocab",
    "read_token_file",
    "scan_max_token_id",
    "write_token_file",
]

MAGIC = "lightning_perf.tokens"
VERSION = 1
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
PREPARE_HINT = "create it with `lightning-perf prepare --input <text files or dirs> --out_dir <dir>`"
SCAN_CHUNK_TOKENS = 64 * 2**20  # 128 / 256 MB of uint16 / uint32 per step of a scan


def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` when every id fits (vocab <= 65535), else ``"uint32"``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return "uint16" if vocab_size <= 65535 else "uint32"


@dataclass(frozen=True, kw_only=True)
class TokenFileMeta:
    """Contents of a token file's JSON sidecar."""

    dtype: str
    num_tokens: int
    vocab_size: int
    tokenizer: str = "byte"
    magic: str = MAGIC
    version: int = VERSION
    max_token_id: int | None = None
    # a tokenizer.json tokenizer: the first 16 hex digits of the file's SHA-256 (None: the byte tokenizer)
    tokenizer_hash: str | None = None

    def __post_init__(self) -> None:
        if self.magic != MAGIC:
            raise ValueError(f"magic is {self.magic!r}, expected {MAGIC!r}: not a lightning_perf token file")
        if self.version != VERSION:
            raise ValueError(f"token file version {self.version} is not supported (this release reads {VERSION})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.num_tokens < 0 or self.vocab_size < 1:
            raise ValueError(f"num_tokens ({self.num_tokens}) must be >= 0 and vocab_size ({self.vocab_size}) >= 1")
        if self.vocab_size > np.iinfo(_DTYPES[self.dtype]).max + 1:
            raise ValueError(f"vocab_size {self.vocab_size} does not fit dtype {self.dtype}")
        if self.max_token_id is not None:
            if not isinstance(self.max_token_id, int) or isinstance(self.max_token_id, bool) or self.max_token_id < 0:
                raise ValueError(f"max_token_id must be null or an integer >= 0, got {self.max_token_id!r}")
            if self.num_tokens == 0:
                raise ValueError(f"max_token_id is {self.max_token_id} but the file holds no tokens")
            if self.max_token_id >= self.vocab_size:
                raise ValueError(
                    f"max_token_id is {self.max_token_id} but vocab_size is {self.vocab_size}:"
                    " the file holds token ids outside its vocabulary"
                )

    @property
    def itemsize(self) -> int:
        return np.dtype(_DTYPES[self.dtype]).itemsize


def _paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(x.bin, x.json)`` for ``x``, ``x.bin`` or ``x.json``."""
    p = Path(path)
    stem = p.with_suffix("") if p.suffix in (".bin", ".json") else p
    return stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + ".json")


def read_meta(path: str | os.PathLike) -> TokenFileMeta:
    """Read and validate the sidecar of token file ``path`` (``x``, ``x.bin`` or ``x.json``).

    Raises ``FileNotFoundError`` naming the missing file and how to create it, and
    ``ValueError`` naming the file for a malformed or inconsistent sidecar (a size that
    does not match ``num_tokens``, a ``max_token_id`` not below ``vocab_size``).
    """
    bin_path, meta_path = _paths(path)
    for p in (bin_path, meta_path):
        if not p.is_file():
            raise FileNotFoundError(f"token file {p} does not exist; {PREPARE_HINT}")
    try:
        raw = json.loads(meta_path.read_text())
        meta = TokenFileMeta(**raw)
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{meta_path}: invalid token file metadata: {err}") from err
    size = bin_path.stat().st_size
    expected = meta.num_tokens * meta.itemsize
    if size != expected:
        raise ValueError(
            f"{bin_path} has {size} bytes but {meta_path.name} says num_tokens={meta.num_tokens} of {meta.dtype}"
            f" ({meta.itemsize} bytes each) = {expected} bytes; the file is truncated or corrupted,"
            f" re-create it ({PREPARE_HINT})"
        )
    return meta


def read_token_file(path: str | os.PathLike) -> tuple[np.ndarray, TokenFileMeta]:
    """Memory-map token file ``path`` after validating it (see :func:`read_meta`)."""
    meta = read_meta(path)
    bin_path, _ = _paths(path)
    if meta.num_tokens == 0:
        return np.zeros(0, dtype=_DTYPES[meta.dtype]), meta
    return np.memmap(bin_path, dtype=_DTYPES[meta.dtype], mode="r", shape=(meta.num_tokens,)), meta


def scan_max_token_id(tokens: np.ndarray, chunk_tokens: int = SCAN_CHUNK_TOKENS) -> int | None:
    """Largest id in ``tokens`` (``None`` when empty), read ``chunk_tokens`` at a time so
    a memory-mapped file of any size is scanned in bounded memory."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if len(tokens) == 0:
        return None
    return max(int(tokens[i : i + chunk_tokens].max()) for i in range(0, len(tokens), chunk_tokens))


def write_token_file(
    path: str | os.PathLike,
    tokens: np.ndarray,
    *,
    vocab_size: int,
    tokenizer: str = "byte",
    dtype: str | None = None,
    tokenizer_hash: str | None = None,
) -> TokenFileMeta:
    """Write ``tokens`` to ``path.bin`` + ``path.json`` (``dtype`` defaults to the
    smallest that holds ``vocab_size``; the sidecar records ``max_token_id``). Ids must
    lie in ``[0, vocab_size)``."""
    tokens = np.asarray(tokens).reshape(-1)
    dtype = dtype or dtype_for_vocab(vocab_size)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids span [{int(tokens.min())}, {int(tokens.max())}] but vocab_size is {vocab_size}")
    max_id = int(tokens.max()) if tokens.size else None
    meta = TokenFileMeta(
        dtype=dtype, num_tokens=int(tokens.size), vocab_size=vocab_size, tokenizer=tokenizer, max_token_id=max_id,
        tokenizer_hash=tokenizer_hash,
    )
    bin_path, meta_path = _paths(path)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = bin_path.with_name(bin_path.name + ".tmp")
    tokens.astype(_DTYPES[dtype]).tofile(tmp)
    os.replace(tmp, bin_path)
    meta_path.write_text(json.dumps(asdict(meta), indent=2) + "\n")
    return meta


class MemmapTokenDataset(TokenWindowDataset):
    """:class:`TokenWindowDataset` over a validated, memory-mapped token file (``documents``: packed
    documents, see :class:`TokenWindowDataset`)."""

    def __init__(self, path: str | os.PathLike, seq_len: int, *, documents: DocumentBoundaries | None = None) -> None:
        tokens, meta = read_token_file(path)
        super().__init__(tokens, seq_len, name=str(_paths(path)[0]), vocab_size=meta.vocab_size, documents=documents)
        self.path = Path(path)
        self.meta = meta

    def __getstate__(self) -> dict:
        # Pickling a memmap copies its data; workers started with "spawn" re-open the file instead.
        state = dict(self.__dict__)
        state["tokens"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens, _ = read_token_file(self.path)
