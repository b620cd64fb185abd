"""The built-in corpus: the Python standard library's own source files.

Every machine that runs this package has them, so a real (if small) language
modelling task needs no download. The files of the running interpreter's stdlib
directory (``sysconfig.get_paths()["stdlib"]``) are read at run time, without
``site-packages`` and the test suites, byte-tokenized, each file written as
``<bos> bytes <eos>`` (the layout ``prepare`` writes too).

Determinism: which files are used and their order depend only on the file paths
(relative to the stdlib directory) and ``max_bytes``; the train/val split is by file,
decided by a hash of the path, so no file is in both splits and the split of a file
never changes when ``max_bytes`` does. The corpus differs between Python versions,
as their stdlibs do.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lightning_perf.data.tokenizer import ByteTokenizer

__all__ = ["DEFAULT_MAX_BYTES", "StdlibCorpus", "build_stdlib_corpus", "stdlib_source_files"]

DEFAULT_MAX_BYTES = 4_000_000
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def _unit_hash(salt: str, rel: str) -> float:
    """A number in [0, 1) that depends only on ``salt`` and the path."""
    digest = hashlib.sha1(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[tuple[str, int]]:
    """``(relative posix path, size in bytes)`` of every ``*.py`` file under the stdlib
    directory ``root`` (default: the running interpreter's), in a fixed pseudo-random
    order given by a hash of the path, so that a byte cap still samples all packages."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library directory {root} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):  # empty files (many __init__.py) carry no text
                path = Path(dirpath, name)
                if path.is_file() and (size := path.stat().st_size) > 0:
                    files.append((path.relative_to(root).as_posix(), size))
    files.sort(key=lambda item: (_unit_hash("order", item[0]), item[0]))
    return files


@dataclass(frozen=True, kw_only=True)
class StdlibCorpus:
    """Byte tokens of the selected stdlib files, split by file."""

    root: str
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    train_tokens: np.ndarray = field(repr=False)  # uint16, read-only; <bos> file <eos> per file
    val_tokens: np.ndarray = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return ByteTokenizer.vocab_size


def build_stdlib_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES, *, val_fraction: float = 0.05, root: str | os.PathLike | None = None
) -> StdlibCorpus:
    """Read and tokenize the stdlib sources (at most ``max_bytes`` of source in total).

    Files are taken in :func:`stdlib_source_files` order while they fit in the cap
    (a file that does not fit is skipped). A file goes to validation when the hash of
    its path is below ``val_fraction``; at least one file goes to each split.

    The result is cached per process for the same arguments (a few MB, built in well
    under a second), so every rank and every ``setup`` call shares one copy.
    """
    if max_bytes < 1:
        raise ValueError(f"builtin max_bytes must be >= 1, got {max_bytes}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    root = str(Path(root if root is not None else sysconfig.get_paths()["stdlib"]).resolve())
    return _build_cached(max_bytes, val_fraction, root)


@functools.lru_cache(maxsize=4)
def _build_cached(max_bytes: int, val_fraction: float, root: str) -> StdlibCorpus:
    chosen: list[str] = []
    total = 0
    for rel, size in stdlib_source_files(root):
        if total + size <= max_bytes:
            chosen.append(rel)
            total += size
    if len(chosen) < 2:
        raise ValueError(
            f"builtin_max_bytes={max_bytes} holds {len(chosen)} stdlib file(s); at least 2 are needed"
            f" (one for training, one for validation): raise it (the default is {DEFAULT_MAX_BYTES})"
        )
    val = [rel for rel in chosen if _unit_hash("split", rel) < val_fraction]
    if not val:  # tiny caps: take the file closest to the validation side
        val = [min(chosen, key=lambda rel: _unit_hash("split", rel))]
    if len(val) == len(chosen):
        val = val[:-1]
    val_set = set(val)
    train = [rel for rel in chosen if rel not in val_set]
    return StdlibCorpus(
        root=root,
        train_files=tuple(train),
        val_files=tuple(val),
        train_tokens=_tokenize_files(root, train),
        val_tokens=_tokenize_files(root, val),
    )


def _tokenize_files(root: str, rels: list[str]) -> np.ndarray:
    bos = np.array([ByteTokenizer.bos_id], dtype=np.uint16)
    eos = np.array([ByteTokenizer.eos_id], dtype=np.uint16)
    parts = []
    for rel in rels:
        parts.append(bos)
        parts.append(np.frombuffer(Path(root, rel).read_bytes(), dtype=np.uint8).astype(np.uint16))
        parts.append(eos)
    tokens = np.concatenate(parts)
    tokens.setflags(write=False)
    return tokens
