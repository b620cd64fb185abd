"""Token files: prepare round trip, validation of corrupted / missing files, token ids
checked against the vocabularies at setup."""

from __future__ import annotations

import json
import pickle
import sys
import warnings

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
from lightning_perf.data.memmap import read_meta, scan_max_token_id
from lightning_perf.data.prepare import main as prepare_main

prepare_module = sys.modules["lightning_perf.data.prepare"]  # the package exports a function of the same name

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


def test_prepare_records_the_largest_token_id(text_dir, tmp_path):
    (tmp_path / "one.txt").write_text("a single file, split as a stream: " * 40)
    for inputs, out in (([text_dir], tmp_path / "docs"), ([tmp_path / "one.txt"], tmp_path / "stream")):
        metas = prepare(inputs, out, val_fraction=0.1)
        for split in ("train", "val"):
            tokens, meta = read_token_file(out / split)
            assert meta.max_token_id == metas[split].max_token_id == int(np.max(tokens))
            assert json.loads((out / f"{split}.json").read_text())["max_token_id"] == meta.max_token_id
    # streamed: the training part has no <eos>, so its largest id is <bos> (256)
    assert read_meta(tmp_path / "stream" / "train").max_token_id == ByteTokenizer().bos_id
    assert read_meta(tmp_path / "stream" / "val").max_token_id == ByteTokenizer().eos_id


def test_scan_max_token_id_in_chunks(tmp_path):
    ids = np.arange(1000) % 100
    ids[777] = 3000
    write_token_file(tmp_path / "t", ids, vocab_size=3001)
    tokens, meta = read_token_file(tmp_path / "t")
    assert meta.max_token_id == 3000
    assert scan_max_token_id(tokens) == scan_max_token_id(tokens, chunk_tokens=7) == 3000
    assert scan_max_token_id(np.zeros(0, dtype=np.uint16)) is None
    assert write_token_file(tmp_path / "empty", np.zeros(0), vocab_size=10).max_token_id is None


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
    assert meta["max_token_id"] == 49
    # metadata that lies about the vocabulary and records no max_token_id (an older sidecar)
    del meta["max_token_id"]
    (tmp_path / "train.json").write_text(json.dumps({**meta, "vocab_size": 40}))
    ds = MemmapTokenDataset(tmp_path / "train", seq_len=9)
    assert ds[3][0].tolist() == list(range(27, 36))
    with pytest.raises(ValueError, match=r"train\.bin: sample 5 \(tokens 45\.\.54\) holds id 49 >= vocab_size 40"):
        ds[5]
    # with max_token_id recorded, the same lie is refused when the metadata is read
    (tmp_path / "train.json").write_text(json.dumps({**meta, "vocab_size": 40, "max_token_id": 49}))
    with pytest.raises(ValueError, match=r"train\.json: .*max_token_id is 49 but vocab_size is 40"):
        MemmapTokenDataset(tmp_path / "train", seq_len=9)


def _hand_written(data_dir, train_ids, *, vocab_size=260, record_max=True):
    """train/val token files written without ``write_token_file``'s checks, as another tool might."""
    for split, ids in (("train", np.asarray(train_ids)), ("val", np.arange(64) % vocab_size)):
        ids.astype(np.uint16).tofile(data_dir / f"{split}.bin")
        meta = {"magic": "lightning_perf.tokens", "version": 1, "dtype": "uint16", "num_tokens": int(ids.size),
                "vocab_size": vocab_size, "tokenizer": "byte"}
        if record_max:
            meta["max_token_id"] = int(ids.max())
        (data_dir / f"{split}.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("record_max", [True, False], ids=["recorded", "old-metadata"])
def test_ids_beyond_the_metadata_vocabulary_fail_at_setup(tmp_path, record_max):
    ids = np.arange(5000) % 200
    ids[4321] = 300  # one bad id deep in the file
    _hand_written(tmp_path, ids, record_max=record_max)
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=16, batch_size=2)
    with pytest.raises(ValueError) as err:
        data.setup("fit")
    msg = str(err.value)
    assert "token id 300" in msg or "max_token_id is 300" in msg
    assert "vocab_size is 260" in msg and str(tmp_path / ("train.json" if record_max else "train.bin")) in msg
    assert data.train_dataset is None


@pytest.mark.parametrize("record_max", [True, False], ids=["recorded", "old-metadata"])
def test_ids_beyond_the_model_vocabulary_fail_before_training(tmp_path, record_max):
    """Metadata consistent with the file (vocab 320) but the model's vocabulary is 260: refused
    in setup, before the first step, naming the file and the id."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_perf.models import GPTLightningModule

    class Steps(Callback):
        def __init__(self):
            self.count = 0

        def on_train_batch_start(self, *args):
            self.count += 1

    ids = np.arange(5000) % 200
    ids[4321] = 300
    _hand_written(tmp_path, ids, vocab_size=320, record_max=record_max)
    model = GPTLightningModule("tiny", block_size=16)
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=16, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[steps := Steps()])
    match = rf"{tmp_path / 'train.bin'} holds token id 300 but the model's vocab_size is 260"
    if record_max:
        with pytest.raises(ValueError, match=match):
            trainer.fit(model, data)
    else:
        with pytest.warns(UserWarning, match=r"records no max_token_id.*re-run `lightning-perf prepare`"):
            with pytest.raises(ValueError, match=match):
                trainer.fit(model, data)
    assert steps.count == 0 and data.train_dataset is None


def test_old_metadata_without_max_token_id_still_loads(tmp_path):
    for split in ("train", "val"):
        write_token_file(tmp_path / split, np.arange(500) % 250, vocab_size=260)
        meta = json.loads((tmp_path / f"{split}.json").read_text())
        del meta["max_token_id"]
        (tmp_path / f"{split}.json").write_text(json.dumps(meta))
    assert read_meta(tmp_path / "train").max_token_id is None
    assert read_token_file(tmp_path / "val")[0].tolist() == (np.arange(500) % 250).tolist()
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=16, batch_size=2)
    with pytest.warns(UserWarning, match="records no max_token_id") as record:
        data.setup("fit")
    messages = [str(w.message) for w in record]
    for split in ("train", "val"):
        assert any(f"{split}.json records no max_token_id" in m and "largest id (249)" in m for m in messages)
    assert data.vocab_size == 260 and len(data.train_dataset) == 499 // 16
    x, _ = next(iter(data.train_dataloader()))
    assert x.shape == (2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.setup("validate")  # scanned once per data module


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"magic": "something else"}, "magic"),
        ({"dtype": "float32"}, "dtype"),
        ({"version": 99}, "version"),
        ({"vocab_size": 70000}, "does not fit"),
        ({"max_token_id": 260}, "max_token_id is 260 but vocab_size is 260"),
        ({"max_token_id": -1}, "max_token_id must be null or an integer >= 0"),
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


def test_prepare_reports_every_skipped_entry(text_dir, tmp_path, capsys):
    (text_dir / "log.txt").write_bytes(b"a text file with one NUL \x00 byte in it")
    (text_dir / ".git").mkdir()
    (text_dir / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    skipped = []
    prepare([text_dir], tmp_path / "out", val_fraction=0.05, on_skip=lambda p, why: skipped.append((p.name, why)))
    reasons = dict(skipped)
    assert set(reasons) == {"blob.bin", "log.txt", ".hidden", ".git"}
    assert "NUL byte" in reasons["log.txt"] and "hidden" in reasons[".hidden"] and "hidden" in reasons[".git"]
    # the library warns by default; the command prints one line per entry
    with pytest.warns(UserWarning, match="prepare skipped .*log.txt: a NUL byte"):
        prepare([text_dir], tmp_path / "out", val_fraction=0.05)
    prepare_main(["--input", str(text_dir), "--out_dir", str(tmp_path / "out"), "--val_fraction", "0.05",
                  "--seq_len", "8"])
    out = capsys.readouterr().out
    assert f"skipped {text_dir / 'log.txt'}: a NUL byte in its first 8 KiB" in out
    assert f"skipped {text_dir / 'blob.bin'}" in out and f"skipped {text_dir / '.git'}: hidden directory" in out


def test_prepare_refuses_a_split_shorter_than_one_sample(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("x" * 998)  # 1000 tokens
    out = tmp_path / "out"
    prepare([tmp_path / "one.txt"], out, val_fraction=0.5)  # earlier files, which a refusal must leave alone
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # the validation share: 10 tokens, fewer than seq_len + 1
    with pytest.raises(ValueError, match=r"the val split would hold 10 tokens, .* seq_len \+ 1 = 257 .*"
                                         r"raise --val_fraction to 0.257 or more"):
        prepare([tmp_path / "one.txt"], out, val_fraction=0.01, seq_len=256)
    # the training share
    with pytest.raises(ValueError, match=r"the train split would hold 100 tokens, .* lower --val_fraction to 0.743"):
        prepare([tmp_path / "one.txt"], out, val_fraction=0.9, seq_len=256)
    # too little text for any split
    with pytest.raises(ValueError, match="add text"):
        prepare([tmp_path / "one.txt"], out, val_fraction=0.5, seq_len=999)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the suggested fraction works
    metas = prepare([tmp_path / "one.txt"], tmp_path / "fixed", val_fraction=0.257, seq_len=256)
    assert metas["val"].num_tokens >= 257 and metas["train"].num_tokens >= 257
    # the command refuses with its default seq_len (256) in two lines, the usage left out
    with pytest.raises(SystemExit) as exit_:
        prepare_main(["--input", str(tmp_path / "one.txt"), "--out_dir", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage" not in err and len(err.strip().splitlines()) == 1
    assert "the val split would hold 10 tokens" in err


def test_prepare_holds_out_whole_documents_only_when_they_make_a_sample(tmp_path):
    """With seq_len, held-out documents shorter than one sample give way to the stream split."""
    from lightning_perf.data.prepare import _in_val

    texts = tmp_path / "texts"
    texts.mkdir()
    held = set()
    for i in range(40):  # the documents the path hash holds out are short, the others long
        name = f"doc{i:02d}.txt"
        short = _in_val(name, 0.1)
        held |= {name} if short else set()
        (texts / name).write_text(f"held {i}\n" if short else f"document {i} " * 40)
    assert 0 < len(held) < 40
    by_doc = prepare([texts], tmp_path / "a", val_fraction=0.1)
    val_docs = _split_documents(np.asarray(read_token_file(tmp_path / "a" / "val")[0]))
    assert sorted(val_docs) == sorted((texts / n).read_text() for n in held)
    small = by_doc["val"].num_tokens
    total = small + by_doc["train"].num_tokens
    # documents holding one sample (seq_len + 1 tokens) stay whole
    assert prepare([texts], tmp_path / "b", val_fraction=0.1, seq_len=small - 1)["val"].num_tokens == small
    # one token short: the last 10% of the token stream instead
    metas = prepare([texts], tmp_path / "c", val_fraction=0.1, seq_len=small)
    assert metas["val"].num_tokens == int(np.ceil(total * 0.1)) > small
    val = ByteTokenizer().decode(np.asarray(read_token_file(tmp_path / "c" / "val")[0]))
    assert val.endswith("document 39 " * 40)


def test_short_validation_split_only_matters_when_validation_runs(tmp_path):
    import lightning as L

    write_token_file(tmp_path / "train", np.arange(200) % 250, vocab_size=260)
    write_token_file(tmp_path / "val", np.arange(5), vocab_size=260)
    for limit, ok in ((0, True), (0.0, True), (2, False), (1.0, False)):
        data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=16, batch_size=2)
        data.trainer = L.Trainer(accelerator="cpu", limit_val_batches=limit, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False)
        if ok:
            data.setup("fit")
            assert len(data.train_dataset) == 12 and len(data.val_dataset) == 0
        else:
            with pytest.raises(ValueError, match=r"val split .* limit_val_batches=0"):
                data.setup("fit")
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=16, batch_size=2)
    with pytest.raises(ValueError, match="val split"):  # validate itself needs the split
        data.setup("validate")


def test_missing_data_dir_is_named(tmp_path):
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path / "nodir"), seq_len=16)
    with pytest.raises(FileNotFoundError, match=r"data_dir .*nodir does not exist: create it with `lightning-perf"):
        data.setup("fit")


def test_prepare_skips_empty_and_non_utf8_files_named_or_found(tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "good.txt").write_text("a line of text\n" * 40, encoding="utf-8")
    (texts / "empty.txt").write_bytes(b"")
    (texts / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))  # é is 0xe9 at offset 3
    # an invalid byte past the first chunk, after a character split across the chunks' border
    late = b"x" * (prepare_module._BINARY_PROBE - 1) + "é".encode() + b"ok\xff"
    (texts / "late.txt").write_bytes(late)
    expected = {
        "empty.txt": "empty file",
        "latin1.txt": "not UTF-8 text (byte 0xe9 at offset 3): re-encode it as UTF-8",
        "late.txt": f"not UTF-8 text (byte 0xff at offset {len(late) - 1}): re-encode it as UTF-8",
    }
    for inputs in ([texts], sorted(texts.iterdir())):  # a directory walked, or each file named
        skipped = []
        metas = prepare(inputs, tmp_path / "out", val_fraction=0.1,
                        on_skip=lambda path, why: skipped.append((path.name, why)))
        assert dict(skipped) == expected
        assert metas["train"].num_tokens + metas["val"].num_tokens == len("a line of text\n" * 40) + 2  # good.txt only
    # the command prints one line each; with nothing left, the error says why
    prepare_main(["--input", str(texts), "--out_dir", str(tmp_path / "out"), "--val_fraction", "0.1", "--seq_len", "8"])
    out = capsys.readouterr().out
    assert f"skipped {texts / 'empty.txt'}: empty file" in out
    assert f"skipped {texts / 'latin1.txt'}: not UTF-8 text (byte 0xe9 at offset 3)" in out
    with pytest.raises(SystemExit):
        prepare_main(["--input", str(texts / "empty.txt"), "--out_dir", str(tmp_path / "none")])
    captured = capsys.readouterr()
    assert f"skipped {texts / 'empty.txt'}: empty file" in captured.out
    assert "no text files found" in captured.err and "1 skipped" in captured.err
