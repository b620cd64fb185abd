"""Token files: prepare round trip, validation of corrupted / missing files."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from lightning_perf.data import (
    ByteTokenizer,
    MemmapTokenDataset,
    TokenDataModule,
    prepare,
    read_token_file,
    write_token_file,
)
from lightning_perf.data.prepare import main as prepare_main

DOCS = {
    "a.txt": "first document\n",
    "b/c.py": "def f(x):\n    return x * 2\n",
    "b/d.md": "# Überschrift\n\nünïcödé ✓\n",
    **{f"many/doc{i:03d}.txt": f"document number {i}\n" * (i % 7 + 1) for i in range(200)},
}


@pytest.fixture
def text_dir(tmp_path):
    root = tmp_path / "texts"
    for rel, text in DOCS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("not a document")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    return root


def _split_documents(tokens: np.ndarray) -> list[str]:
    tok = ByteTokenizer()
    ends = np.flatnonzero(tokens == tok.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(int)
    docs = []
    for s, e in zip(starts, ends):
        assert tokens[s] == tok.bos_id
        docs.append(tok.decode(tokens[s : e + 1]))
    assert len(ends) == 0 or ends[-1] == len(tokens) - 1
    return docs


def test_prepare_round_trip_by_document(text_dir, tmp_path):
    out = tmp_path / "tokens"
    metas = prepare([text_dir], out, val_fraction=0.05)
    train, train_meta = read_token_file(out / "train")
    val, val_meta = read_token_file(out / "val.bin")
    assert metas["train"] == train_meta and metas["val"] == val_meta
    assert train_meta.dtype == "uint16" and train_meta.vocab_size == 260 and train_meta.tokenizer == "byte"
    assert json.loads((out / "train.json").read_text())["magic"] == "lightning_perf.tokens"
    train_docs, val_docs = _split_documents(np.asarray(train)), _split_documents(np.asarray(val))
    # every document exactly once, whole, in one split only; hidden and binary files skipped
    assert sorted(train_docs + val_docs) == sorted(DOCS.values())
    assert 1 <= len(val_docs) <= 30
    assert train_meta.num_tokens + val_meta.num_tokens == sum(len(t.encode()) + 2 for t in DOCS.values())
    # deterministic, and independent of where the data lies
    moved = tmp_path / "elsewhere"
    text_dir.rename(moved)
    prepare([moved], tmp_path / "again", val_fraction=0.05)
    assert np.array_equal(read_token_file(tmp_path / "again" / "val")[0], val)
    assert np.array_equal(read_token_file(tmp_path / "again" / "train")[0], train)


def test_prepare_single_file_splits_the_stream(tmp_path):
    text = "".join(f"line {i} of one long file\n" for i in range(500))
    (tmp_path / "one.txt").write_text(text)
    prepare_main(["--input", str(tmp_path / "one.txt"), "--out_dir", str(tmp_path / "out"), "--val_fraction", "0.1"])
    train, meta = read_token_file(tmp_path / "out" / "train")
    val, val_meta = read_token_file(tmp_path / "out" / "val")
    assert meta.num_tokens + val_meta.num_tokens == len(text) + 2
    assert val_meta.num_tokens == int(np.ceil((len(text) + 2) * 0.1))
    joined = np.concatenate([train, val])
    assert ByteTokenizer().decode(joined) == text
    assert joined[0] == 256 and joined[-1] == 257


def test_prepare_bad_input(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nope"):
        prepare([tmp_path / "nope"], tmp_path / "out")
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="val_fraction"):
        prepare([tmp_path / "x.txt"], tmp_path / "out", val_fraction=1.5)
    with pytest.raises(ValueError, match="tokenizer"):
        prepare([tmp_path / "x.txt"], tmp_path / "out", tokenizer="gpt2")
    with pytest.raises(SystemExit):
        prepare_main(["--input", str(tmp_path / "nope"), "--out_dir", str(tmp_path / "out")])
    assert "nope" in capsys.readouterr().err


def test_token_file_dtype_by_vocab(tmp_path):
    small = write_token_file(tmp_path / "s", np.array([0, 65534]), vocab_size=65535)
    big = write_token_file(tmp_path / "b", np.array([0, 70000]), vocab_size=70001)
    assert small.dtype == "uint16" and big.dtype == "uint32"
    assert (tmp_path / "s.bin").stat().st_size == 4 and (tmp_path / "b.bin").stat().st_size == 8
    tokens, _ = read_token_file(tmp_path / "b")
    assert tokens.tolist() == [0, 70000]
    with pytest.raises(ValueError, match="vocab_size is 100"):
        write_token_file(tmp_path / "bad", np.array([5, 100]), vocab_size=100)


def test_wrong_size_file_is_refused_with_its_name(tmp_path):
    write_token_file(tmp_path / "train", np.arange(100), vocab_size=260)
    with open(tmp_path / "train.bin", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(ValueError) as err:
        read_token_file(tmp_path / "train")
    msg = str(err.value)
    assert str(tmp_path / "train.bin") in msg and "201" in msg and "200" in msg
    # truncated
    (tmp_path / "train.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=r"train\.bin has 10 bytes"):
        MemmapTokenDataset(tmp_path / "train", seq_len=4)


def test_ids_beyond_the_vocabulary_are_refused_per_sample(tmp_path):
    write_token_file(tmp_path / "train", np.arange(100) % 50, vocab_size=260)
    meta = json.loads((tmp_path / "train.json").read_text())
    (tmp_path / "train.json").write_text(json.dumps({**meta, "vocab_size": 40}))  # metadata lies
    ds = MemmapTokenDataset(tmp_path / "train", seq_len=9)
    assert ds[3][0].tolist() == list(range(27, 36))
    with pytest.raises(ValueError, match=r"train\.bin: sample 5 \(tokens 45\.\.54\) holds id 49 >= vocab_size 40"):
        ds[5]


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"magic": "something else"}, "magic"),
        ({"dtype": "float32"}, "dtype"),
        ({"version": 99}, "version"),
        ({"vocab_size": 70000}, "does not fit"),
    ],
)
def test_bad_metadata_is_refused(tmp_path, patch, match):
    write_token_file(tmp_path / "val", np.arange(10), vocab_size=260)
    meta = json.loads((tmp_path / "val.json").read_text())
    (tmp_path / "val.json").write_text(json.dumps({**meta, **patch}))
    with pytest.raises(ValueError, match=match) as err:
        read_token_file(tmp_path / "val")
    assert "val.json" in str(err.value)


def test_missing_files_say_how_to_create_them(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        read_token_file(tmp_path / "train")
    assert str(tmp_path / "train.bin") in str(err.value) and "lightning-perf prepare" in str(err.value)
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=8)
    with pytest.raises(FileNotFoundError, match="prepare"):
        data.setup("fit")
    write_token_file(tmp_path / "train", np.arange(50) % 260, vocab_size=260)
    with pytest.raises(FileNotFoundError, match=r"val\.bin"):
        data.setup("fit")


def test_memmap_datamodule_reads_separate_files(text_dir, tmp_path):
    prepare([text_dir], tmp_path / "tok", val_fraction=0.05)
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path / "tok"), seq_len=16, batch_size=4, shuffle=False)
    assert data.vocab_size == 260
    data.setup("fit")
    train, _ = read_token_file(tmp_path / "tok" / "train")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (4, 16) and x.dtype == torch.int64
    assert x.flatten().tolist() == np.asarray(train[:64]).tolist()
    assert torch.equal(x[:, 1:], y[:, :-1])
    val_inputs = torch.cat([b[0].flatten() for b in data.val_dataloader()])
    val, _ = read_token_file(tmp_path / "tok" / "val")
    assert val_inputs.tolist() == np.asarray(val[: val_inputs.numel()]).tolist()
    # the model's vocabulary must cover the data's
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the vocabulary of the memmap data"):
        _ = TokenDataModule(source="memmap", data_dir=str(tmp_path / "tok"), vocab_size=100).vocab_size
    assert TokenDataModule(source="memmap", data_dir=str(tmp_path / "tok"), vocab_size=320).vocab_size == 320


def test_memmap_dataset_pickles_by_path(tmp_path):
    write_token_file(tmp_path / "train", np.arange(1000) % 260, vocab_size=260)
    ds = MemmapTokenDataset(tmp_path / "train", seq_len=10)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the tokens are not copied into the pickle
    copy = pickle.loads(blob)
    assert torch.equal(copy[7][0], ds[7][0]) and len(copy) == len(ds) == 99
