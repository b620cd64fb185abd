"""``prepare``: tokenize text files into the ``train.bin`` / ``val.bin`` token files
that ``TokenDataModule(source="memmap", data_dir=...)`` reads.

    lightning-perf prepare --input my_texts/ notes.txt --out_dir data/mine

Each input file is one document, written as ``<bos> tokens <eos>``: UTF-8 bytes with the
built-in byte tokenizer (the default), or the ids of a Hugging Face ``tokenizer.json``
(``--tokenizer <folder>``, the ``tokenizers`` library, offline; its begin / end tokens
where it has them). The sidecars record the tokenizer's name, hash and vocabulary size. Directories are
walked recursively (hidden entries skipped). A file that is empty, has a NUL byte in its first 8 KiB
(taken for binary) or is not UTF-8 text is skipped, whether named or found in a directory; each
skipped entry is reported with its reason. Documents
are processed in sorted path order and go to validation when a hash of their path is below
``val_fraction``, so the split is deterministic and no document is in both files. When that cannot
work (too few documents, e.g. one big text file, held-out documents holding more than twice
``val_fraction`` of the tokens, or, with ``seq_len``, fewer tokens than one sample) the last
``val_fraction`` of the token stream is used. With ``seq_len`` (the command's ``--seq_len``,
256 by default) a split that cannot hold one sample of ``seq_len + 1`` tokens is refused before any
file is replaced, with what to change.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lightning_perf.data.hf_tokenizer import load_tokenizer
from lightning_perf.data.memmap import TokenFileMeta, dtype_for_vocab

__all__ = ["collect_documents", "main", "prepare"]


# the TokenDataModule's default seq_len: what `prepare --seq_len` checks the splits against by default
DEFAULT_SEQ_LEN = 256
_BINARY_PROBE = 8192
_UTF8_CHUNK = 1 << 20


def _not_text(path: Path) -> str | None:
    """Why the file at ``path`` is no text document (empty, binary, not UTF-8), or None when it is one.
    Reads the file through once, a chunk at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_BINARY_PROBE if offset == 0 else _UTF8_CHUNK)
            if offset == 0 and not chunk:
                return "empty file"
            if offset == 0 and b"\0" in chunk:
                return f"a NUL byte in its first {_BINARY_PROBE // 1024} KiB: taken for binary"
            pending = len(decoder.getstate()[0])  # bytes of a character split across chunks, held back
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:  # err.start counts from the held-back bytes
                byte = err.object[err.start]
                at = offset - pending + err.start
                return f"not UTF-8 text (byte 0x{byte:02x} at offset {at}): re-encode it as UTF-8"
            if not chunk:
                return None
            offset += len(chunk)


def collect_documents(
    inputs: Sequence[str | os.PathLike], skipped: list[tuple[Path, str]] | None = None
) -> list[tuple[Path, str]]:
    """``(path, key)`` of the text files named by ``inputs`` (files, or directories
    walked recursively), sorted by key, without duplicates. ``key`` is the path
    relative to the input directory (the file name for a file input), so the split
    does not depend on where the data lies. Raises ``FileNotFoundError`` for an input
    that does not exist. ``skipped``, if given, receives ``(path, reason)`` for each entry
    left out: a named file or a walked directory's that is empty, binary or not UTF-8; a walked
    directory's hidden entries and those that are not regular files."""
    found: dict[Path, str] = {}
    skip = skipped if skipped is not None else []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            reason = _not_text(path)
            if reason is None:
                found.setdefault(path.resolve(), path.name)
            else:
                skip.append((path, reason))
        elif path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                skip.extend((Path(dirpath, d), "hidden directory") for d in sorted(dirnames) if d.startswith("."))
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    file = Path(dirpath, name)
                    if name.startswith("."):
                        skip.append((file, "hidden file"))
                    elif not file.is_file():
                        skip.append((file, "not a regular file"))
                    elif (reason := _not_text(file)) is not None:
                        skip.append((file, reason))
                    else:
                        found.setdefault(file.resolve(), file.relative_to(path).as_posix())
        else:
            raise FileNotFoundError(f"prepare input {path} does not exist")
    return sorted(found.items(), key=lambda item: (item[1], str(item[0])))


def _short_split_error(split: str, tokens: int, total: int, seq_len: int, val_fraction: float) -> ValueError:
    need = seq_len + 1
    if total >= 2 * need and split == "val":
        fix = f"raise --val_fraction to {math.ceil(need / total * 1000) / 1000:g} or more, lower --seq_len or add text"
    elif total >= 2 * need:
        most = math.floor((1 - need / total) * 1000) / 1000
        fix = f"lower --val_fraction to {most:g} or less, lower --seq_len or add text"
    else:
        fix = (f"add text (at least {2 * need} tokens in all) or lower --seq_len (the --data.seq_len you will "
               "train with)")
    return ValueError(
        f"the {split} split would hold {tokens} tokens, fewer than one sample of seq_len + 1 = {need} "
        f"({total} tokens in all, val_fraction={val_fraction:g}): {fix}"
    )


def _in_val(key: str, val_fraction: float) -> bool:
    digest = hashlib.sha1(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def prepare(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    val_fraction: float = 0.01,
    tokenizer: str = "byte",
    seq_len: int | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> dict[str, TokenFileMeta]:
    """Tokenize ``inputs`` into ``out_dir/{train,val}.{bin,json}``.

    Args:
        inputs: text files and/or directories.
        out_dir: created if needed; existing token files there are replaced.
        val_fraction: share of the documents (or, with too few documents, of the
            tokens) held out for validation, in (0, 1).
        tokenizer: ``"byte"``, or a folder holding ``tokenizer.json`` (or that file).
        seq_len: if given, each split must hold one sample of ``seq_len + 1`` tokens, else
            ``ValueError`` says what to change and the files in ``out_dir`` stay as they were.
        on_skip: called with ``(path, reason)`` for each input or directory entry left out
            (default: a ``UserWarning`` each).

    Returns:
        ``{"train": TokenFileMeta, "val": TokenFileMeta}``, as written to the sidecars
        (with ``max_token_id``, the largest id each file holds).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    tok = load_tokenizer(tokenizer)
    exact_sizes = tok.name == "byte"
    skipped: list[tuple[Path, str]] = []
    docs = collect_documents(inputs, skipped)
    for path, reason in skipped:
        if on_skip is None:
            warnings.warn(f"prepare skipped {path}: {reason}", stacklevel=2)
        else:
            on_skip(path, reason)
    if not docs:
        left_out = f" ({len(skipped)} skipped, each with its reason above)" if skipped else ""
        raise ValueError(f"no text files found in {[str(i) for i in inputs]}{left_out}")
    # Byte tokens: a document of n bytes is n + 2 tokens, known before reading it; other tokenizers'
    # counts are estimated by the bytes (the split decisions need sizes, not exact counts)
    sizes = {d: d.stat().st_size + 2 for d, _ in docs}
    total = sum(sizes.values())
    val_docs = {d for d, key in docs if _in_val(key, val_fraction)}
    val_share = sum(sizes[d] for d in val_docs) / total
    # by document unless that leaves a split empty or holds out far more than asked
    by_document = 0 < len(val_docs) < len(docs) and val_share <= 2 * val_fraction
    if seq_len is not None and by_document:  # the held-out documents must hold one sample
        held = sum(sizes[d] for d in val_docs)
        by_document = held > seq_len and total - held > seq_len
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(tok.vocab_size)
    val_start = total - max(1, math.ceil(total * val_fraction))  # used when splitting the stream
    counts = {"train": 0, "val": 0}
    max_ids: dict[str, int | None] = {"train": None, "val": None}
    tmp = {split: out / f"{split}.bin.tmp" for split in counts}
    with open(tmp["train"], "wb") as f_train, open(tmp["val"], "wb") as f_val:
        files = {"train": f_train, "val": f_val}

        def write(split: str, ids: np.ndarray) -> None:
            if ids.size:
                ids.tofile(files[split])
                counts[split] += ids.size
                top, prev = int(ids.max()), max_ids[split]
                max_ids[split] = top if prev is None else max(prev, top)

        pos = 0
        for doc, _ in docs:
            ids = tok.encode(doc.read_bytes(), bos=True, eos=True, as_numpy=True).astype(dtype)
            if by_document:
                write("val" if doc in val_docs else "train", ids)
            else:
                cut = min(max(val_start - pos, 0), sizes[doc])
                if not exact_sizes:  # the same share of this document's tokens
                    cut = round(ids.size * cut / sizes[doc])
                write("train", ids[:cut])
                write("val", ids[cut:])
            pos += sizes[doc]
    if seq_len is not None:
        for split in ("train", "val"):
            if counts[split] < seq_len + 1:
                for f in tmp.values():
                    f.unlink(missing_ok=True)
                raise _short_split_error(split, counts[split], sum(counts.values()), seq_len, val_fraction)
    metas = {}
    for split, n in counts.items():
        meta = TokenFileMeta(
            dtype=dtype, num_tokens=n, vocab_size=tok.vocab_size, tokenizer=tok.name, max_token_id=max_ids[split],
            tokenizer_hash=getattr(tok, "hash", None),
        )
        os.replace(tmp[split], out / f"{split}.bin")
        (out / f"{split}.json").write_text(json.dumps(asdict(meta), indent=2) + "\n")
        metas[split] = meta
    return metas


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-perf prepare`` / ``python -m lightning_perf.data.prepare``."""
    p = argparse.ArgumentParser(
        prog="lightning-perf prepare",
        description="Tokenize text files into train.bin/val.bin token files for TokenDataModule(source='memmap').",
    )
    p.add_argument("--input", nargs="+", action="extend", required=True, help="text files or directories")
    p.add_argument("--out_dir", required=True, help="directory for train.bin, val.bin and their .json metadata")
    p.add_argument("--val_fraction", type=float, default=0.01, help="share held out for validation (default 0.01)")
    p.add_argument(
        "--tokenizer", default="byte",
        help="'byte' (default) or a folder holding a Hugging Face tokenizer.json (needs lightning-perf[hf])",
    )
    p.add_argument(
        "--seq_len", type=int, default=DEFAULT_SEQ_LEN,
        help=f"each split must hold one sample of seq_len + 1 tokens: the --data.seq_len you will train with "
        f"(default {DEFAULT_SEQ_LEN})",
    )
    args = p.parse_args(argv)

    def report(path: Path, reason: str) -> None:
        print(f"skipped {path}: {reason}")

    try:
        metas = prepare(args.input, args.out_dir, val_fraction=args.val_fraction, tokenizer=args.tokenizer,
                        seq_len=args.seq_len, on_skip=report)
    except (FileNotFoundError, ValueError, ImportError) as err:  # bad input: the message, not the usage
        sys.stderr.write(f"{p.prog}: error: {err}\n")
        raise SystemExit(2) from err
    for split, meta in metas.items():
        print(f"{Path(args.out_dir) / split}.bin: {meta.num_tokens:,} tokens ({meta.dtype}, vocab {meta.vocab_size})")
    print(f"use it with: --data.source memmap --data.data_dir {args.out_dir}")


if __name__ == "__main__":
    main()
