"""ByteTokenizer, window datasets, synthetic tokens and the built-in stdlib corpus."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_perf.data import (
    ByteTokenizer,
    SyntheticTokenDataset,
    TokenWindowDataset,
    build_stdlib_corpus,
)
from lightning_perf.data.builtin import _build_cached, stdlib_source_files

# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 日本語", "tab\tnew\nline\x00nul", "🙂" * 3])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.array(ids)) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_byte_tokenizer_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 260
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (256, 257, 258, 259)
    ids = tok.encode("ab", bos=True, eos=True)
    assert ids == [256, 97, 98, 257]
    arr = tok.encode("ab", bos=True, eos=True, as_numpy=True)
    assert arr.dtype == np.uint16 and arr.tolist() == ids
    assert tok.decode([256, 97, 258, 259, 98, 257]) == "ab"  # specials skipped


def test_byte_tokenizer_invalid_utf8_and_range():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 97]) == "\ufffda"
    with pytest.raises(ValueError, match="260"):
        tok.decode([97, 260])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])


# ---------------------------------------------------------------- windows


def test_token_window_dataset_windows():
    seq_len = 5
    tokens = np.arange(23, dtype=np.uint16)
    ds = TokenWindowDataset(tokens, seq_len)
    assert len(ds) == (23 - 1) // seq_len == 4
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == list(range(i * seq_len, i * seq_len + seq_len))
        assert y.tolist() == list(range(i * seq_len + 1, i * seq_len + seq_len + 1))
    # non-overlapping: consecutive samples' inputs tile the stream
    assert torch.cat([ds[i][0] for i in range(len(ds))]).tolist() == list(range(20))
    with pytest.raises(IndexError):
        ds[4]
    assert len(TokenWindowDataset(np.arange(5), 5)) == 0  # seq_len + 1 tokens needed
    assert len(TokenWindowDataset(np.arange(6), 5)) == 1
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindowDataset(tokens, 0)


def test_synthetic_is_deterministic_per_index():
    a = SyntheticTokenDataset(vocab_size=320, seq_len=16, num_samples=50, seed=7)
    b = SyntheticTokenDataset(vocab_size=320, seq_len=16, num_samples=50, seed=7)
    # same index, same sample, whatever the access order
    for i in [3, 0, 49, 3]:
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
    x, y = a[3]
    assert x.shape == y.shape == (16,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    samples = torch.stack([a[i][0] for i in range(50)])
    assert samples.min() >= 0 and samples.max() < 320
    assert len({tuple(s.tolist()) for s in samples}) == 50
    # roughly uniform over the vocabulary: every id appears in 50 * 16 = 800 draws of 320? most do
    assert samples.unique().numel() > 250
    other_seed = SyntheticTokenDataset(vocab_size=320, seq_len=16, num_samples=50, seed=8)
    other_stream = SyntheticTokenDataset(vocab_size=320, seq_len=16, num_samples=50, seed=7, stream=1)
    assert not torch.equal(a[0][0], other_seed[0][0])
    assert not torch.equal(a[0][0], other_stream[0][0])
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticTokenDataset(vocab_size=0, seq_len=16, num_samples=5)


# ---------------------------------------------------------------- built-in corpus


def test_builtin_corpus_builds_and_splits_by_file():
    corpus = build_stdlib_corpus(2_000_000)
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(corpus.root) == root
    train, val = set(corpus.train_files), set(corpus.val_files)
    assert train and val and not train & val
    assert all(f.endswith(".py") for f in train | val)
    assert not any(part in ("site-packages", "test", "tests") for f in train | val for part in Path(f).parts)
    # the cap is respected and most of it is used
    total = sum((root / f).stat().st_size for f in train | val)
    assert 1_500_000 < total <= 2_000_000
    # validation is a few percent of the files
    assert 0.005 < len(val) / (len(train) + len(val)) < 0.15
    # one <bos> ... <eos> per file
    for tokens, files in ((corpus.train_tokens, corpus.train_files), (corpus.val_tokens, corpus.val_files)):
        assert tokens.dtype == np.uint16 and tokens.max() < 260
        assert int((tokens == ByteTokenizer.eos_id).sum()) == len(files)
        assert int((tokens == ByteTokenizer.bos_id).sum()) == len(files)
        assert tokens.size == sum((root / f).stat().st_size + 2 for f in files)


def test_builtin_corpus_decodes_to_the_python_sources():
    corpus = build_stdlib_corpus(2_000_000)
    tok = ByteTokenizer()
    root = Path(corpus.root)
    for tokens, files in ((corpus.train_tokens, corpus.train_files), (corpus.val_tokens, corpus.val_files)):
        ends = np.flatnonzero(tokens == tok.eos_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        for i in [0, len(files) // 2, len(files) - 1]:
            doc = tokens[starts[i] : ends[i] + 1]
            assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
            source = (root / files[i]).read_bytes()
            assert doc[1:-1].astype(np.uint8).tobytes() == source
            text = tok.decode(doc)
            assert text == source.decode("utf-8", errors="replace")
            compile(text, files[i], "exec")  # it really is Python


def test_builtin_corpus_is_deterministic_and_split_is_stable_under_the_cap():
    big = build_stdlib_corpus(2_000_000)
    small = build_stdlib_corpus(600_000)
    fresh = _build_cached.__wrapped__(600_000, 0.05, small.root)  # bypass the per-process cache
    assert fresh.train_files == small.train_files and fresh.val_files == small.val_files
    assert np.array_equal(fresh.train_tokens, small.train_tokens)
    assert np.array_equal(fresh.val_tokens, small.val_tokens)
    # a file's split does not depend on the cap (except the fallback for empty splits)
    in_both = (set(big.train_files) | set(big.val_files)) & (set(small.train_files) | set(small.val_files))
    assert len(in_both) > 10
    for f in in_both:
        assert (f in big.val_files) == (f in small.val_files) or len(small.val_files) == 1
    # order comes from the paths only: the listing is stable
    assert stdlib_source_files()[:20] == stdlib_source_files()[:20]


def test_builtin_corpus_bad_cap():
    with pytest.raises(ValueError, match="builtin_max_bytes=10 "):
        build_stdlib_corpus(10)
    with pytest.raises(ValueError, match="max_bytes"):
        build_stdlib_corpus(0)
