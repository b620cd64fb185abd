"""Packed documents in the data: document ids from the corpus's <eos> / <bos>, ignored cross-document
targets, and the resumable, sharded loader unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_perf.data import ByteTokenizer, TokenDataModule, write_token_file
from lightning_perf.data.builtin import build_stdlib_corpus
from lightning_perf.data.documents import DocumentBoundaries

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def _by_hand(window: list[int]) -> tuple[list[int], list[int]]:
    """doc ids of window[:-1] and targets with the cross-document ones at -100, one token at a time."""
    doc, ids, targets = 0, [], []
    for t in range(len(window) - 1):
        if t > 0 and window[t - 1] == EOS:
            doc += 1
        ids.append(doc)
        targets.append(-100 if window[t] == EOS else window[t + 1])
    return ids, targets


def test_docstring_example():
    a, b, c, d, e = 97, 98, 99, 100, 101
    window = np.array([BOS, a, b, EOS, BOS, c, d, EOS, BOS, e], dtype=np.uint16)
    x, y, doc_ids = DocumentBoundaries(eos_id=EOS, bos_id=BOS).sample(window)
    assert x.tolist() == window[:-1].tolist() and x.dtype == torch.int64
    assert doc_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2] and doc_ids.dtype == torch.int32
    assert y.tolist() == [a, b, EOS, -100, c, d, EOS, -100, e]
    _, y_kept, _ = DocumentBoundaries(eos_id=EOS, cross_document_targets=True).sample(window)
    assert y_kept.tolist() == window[1:].tolist()


def test_bos_alone_starts_a_document():
    """A stream written without <eos> still splits at each <bos>; with only <eos>, nothing else does."""
    window = np.array([1, 2, BOS, 3, BOS, 4], dtype=np.int64)
    x, y, doc_ids = DocumentBoundaries(eos_id=EOS, bos_id=BOS).sample(window)
    assert doc_ids.tolist() == [0, 0, 1, 1, 2] and y.tolist() == [2, -100, 3, -100, 4]
    assert DocumentBoundaries(eos_id=EOS).sample(window)[2].tolist() == [0] * 5


def test_builtin_corpus_boundaries_match_its_eos_positions():
    """Every window of the built-in corpus: ids step exactly after each <eos>, the <eos> inputs' targets
    are ignored, all other targets are the next token; the ids count the corpus's documents."""
    data = TokenDataModule(source="builtin", seq_len=64, batch_size=2, pack_documents=True,
                           builtin_max_bytes=300_000, shuffle=False)
    data.setup("fit")
    tokens = build_stdlib_corpus(300_000).train_tokens.astype(np.int64)
    ds = data.train_dataset
    starts = 0
    for i in range(len(ds)):
        x, y, doc_ids = ds[i]
        window = tokens[i * 64: i * 64 + 65].tolist()
        ids, targets = _by_hand(window)
        assert x.tolist() == window[:-1]
        assert doc_ids.tolist() == ids, f"window {i}"
        assert y.tolist() == targets, f"window {i}"
        starts += ids[-1]
    eos_inside = sum(int((tokens[i * 64: i * 64 + 63] == EOS).sum()) for i in range(len(ds)))
    assert starts == eos_inside > 2  # one new id per <eos> that is followed by a token of the same window


def _write_docs(root, lengths, vocab=ByteTokenizer.vocab_size):
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[BOS], rng.integers(0, 256, n - 2), [EOS]]) for n in lengths]
    stream = np.concatenate(docs)
    write_token_file(root / "train", stream, vocab_size=vocab)
    write_token_file(root / "val", stream[:40], vocab_size=vocab)
    return stream


def test_memmap_documents_by_hand(tmp_path):
    """Documents of 5, 12, 3, 20 and 9 tokens; windows of 16: the ids' runs are the documents' pieces."""
    _write_docs(tmp_path, [5, 12, 3, 20, 9])
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=16, batch_size=1,
                           pack_documents=True, shuffle=False)
    data.setup("fit")
    runs = []
    for x, y, doc_ids in data.train_dataloader():
        runs.append(torch.unique_consecutive(doc_ids[0], return_counts=True)[1].tolist())
    # stream positions 0-48: [0,5) [5,17) [17,20) [20,40) [40,49); windows [0,16) [16,32) [32,48)
    assert runs == [[5, 11], [1, 3, 12], [8, 8]]


def test_packed_batches_and_errors(tmp_path):
    _write_docs(tmp_path, [7, 30, 9, 14])
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=8, batch_size=2, pack_documents=True)
    data.setup("fit")
    x, y, doc_ids = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == doc_ids.shape == (2, 8) and doc_ids.dtype == torch.int32
    plain = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=8, batch_size=2)
    plain.setup("fit")
    assert len(next(iter(plain.train_dataloader()))) == 2  # (inputs, targets) as before
    with pytest.raises(ValueError, match="source='synthetic'"):
        TokenDataModule(source="synthetic", vocab_size=64, pack_documents=True)
    meta = (tmp_path / "val.json").read_text().replace('"byte"', '"mystery"')
    (tmp_path / "val.json").write_text(meta)
    with pytest.raises(ValueError, match="mystery"):
        TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=8, pack_documents=True).setup("fit")


def test_resume_and_sharding_keep_their_batches(tmp_path):
    """A loader restored from a mid-epoch state yields the uninterrupted run's next packed batches; two
    data-parallel ranks split the windows between them."""
    _write_docs(tmp_path, [11, 25, 6, 40, 17, 30, 9, 22])

    def module(rank=0, replicas=1):
        data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=8, batch_size=2,
                               pack_documents=True, seed=3)
        data._replicas = lambda: (replicas, rank)
        data.setup("fit")
        return data

    loader = module().train_dataloader()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    rest = [b for b in it]
    resumed = module().train_dataloader()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) > 0
    for a, b in zip(again, rest):
        assert all(torch.equal(s, t) for s, t in zip(a, b)) and len(a) == 3
    seen = [[tuple(x.tolist()) for b in module(r, 2).train_dataloader() for x in b[0]] for r in (0, 1)]
    windows = {tuple(module().train_dataset[i][0].tolist()) for i in range(len(module().train_dataset))}
    assert len(seen[0]) == len(seen[1]) > 0 and not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) <= windows
