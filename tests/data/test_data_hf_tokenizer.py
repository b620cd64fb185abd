"""Token files from a tokenizer.json tokenizer: prepare records it, the data module checks it against
the model's, and the ids round-trip through the tokenizer."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from lightning_perf.data import HFTokenizer, TokenDataModule, prepare  # noqa: E402
from lightning_perf.data.hf_tokenizer import tokenizer_hash  # noqa: E402
from lightning_perf.data.memmap import read_token_file  # noqa: E402

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "the dog sleeps while the fox runs over the hill",
] * 4


def _train_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(SENTENCES, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _texts(folder, n=12):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(SENTENCES[i % 3 : i % 3 + 2]) * 3)
    return folder


def test_prepare_with_tokenizer_json_records_it(tmp_path):
    tok = _train_tokenizer(tmp_path / "tok")
    metas = prepare([_texts(tmp_path / "texts")], tmp_path / "data", val_fraction=0.2, tokenizer=str(tmp_path / "tok"))
    ours = HFTokenizer(tmp_path / "tok")
    for split in ("train", "val"):
        meta = metas[split]
        assert meta.vocab_size == tok.get_vocab_size() == ours.vocab_size
        assert meta.tokenizer == "tokenizer.json:tok" and meta.tokenizer_hash == tokenizer_hash(tmp_path / "tok")
        sidecar = json.loads((tmp_path / "data" / f"{split}.json").read_text())
        assert sidecar["tokenizer_hash"] == meta.tokenizer_hash
    # every document is <s> ids </s>, the ids those of the tokenizers library
    ids, meta = read_token_file(tmp_path / "data" / "train")
    ids = ids.tolist()
    assert ids[0] == tok.token_to_id("<s>") and meta.max_token_id == max(ids)
    first_end = ids.index(tok.token_to_id("</s>"))
    doc_ids = ids[1:first_end]
    assert ours.decode(doc_ids) in {tok.decode(tok.encode(t).ids) for t in
                                    [(tmp_path / "texts" / f"doc{i:02d}.txt").read_text() for i in range(12)]}
    total = metas["train"].num_tokens + metas["val"].num_tokens
    expected = sum(len(tok.encode(p.read_text()).ids) + 2 for p in (tmp_path / "texts").iterdir())
    assert total == expected


def test_data_module_refuses_a_model_with_another_tokenizer(tmp_path):
    from lightning_perf.models import GPT, GPTConfig, GPTLightningModule

    _train_tokenizer(tmp_path / "tok")
    prepare([_texts(tmp_path / "texts")], tmp_path / "bpe", val_fraction=0.2, tokenizer=str(tmp_path / "tok"))
    prepare([_texts(tmp_path / "texts")], tmp_path / "bytes", val_fraction=0.2)
    # a Hugging Face folder: weights + the tokenizer they were trained with
    cfg = GPTConfig.from_name("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=300, block_size=32)
    hf_dir = tmp_path / "hf"
    GPT(cfg).save_hf(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    module = GPTLightningModule.from_hf(hf_dir)
    assert module.tokenizer_hash == tokenizer_hash(tmp_path / "tok")

    def setup(data_dir):
        data = TokenDataModule(source="memmap", data_dir=str(data_dir), seq_len=16, batch_size=2)
        cpu = SimpleNamespace(root_device=torch.device("cpu"))
        data.trainer = SimpleNamespace(lightning_module=module, strategy=cpu)
        data.setup("fit")
        return data

    setup(tmp_path / "bpe")  # same tokenizer: accepted
    with pytest.raises(ValueError, match=r"tokenized by byte.*tokenizer\.json hash"):
        setup(tmp_path / "bytes")


def test_hf_tokenizer_bos_eos_from_tokenizer_config(tmp_path):
    tok = _train_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "</s>", "eos_token": "<unk>"}))
    ours = HFTokenizer(tmp_path / "tok")
    assert ours.bos_id == tok.token_to_id("</s>") and ours.eos_id == tok.token_to_id("<unk>")
    ids = ours.encode("the fox", bos=True, eos=True, as_numpy=True)
    assert isinstance(ids, np.ndarray) and ids[0] == ours.bos_id and ids[-1] == ours.eos_id
    assert ours.decode(torch.tensor(ids[1:-1])) == tok.decode(tok.encode("the fox").ids)


def test_prepare_cli_rejects_a_missing_tokenizer(tmp_path, capsys):
    from lightning_perf.data.prepare import main

    with pytest.raises(SystemExit):
        texts = str(_texts(tmp_path / "t"))
        main(["--input", texts, "--out_dir", str(tmp_path / "d"), "--tokenizer", str(tmp_path / "no")])
    assert "no such folder" in capsys.readouterr().err


def test_data_module_refuses_a_model_vocabulary_smaller_than_the_tokenizers(tmp_path):
    _train_tokenizer(tmp_path / "tok")
    metas = prepare([_texts(tmp_path / "texts")], tmp_path / "bpe", val_fraction=0.2, tokenizer=str(tmp_path / "tok"))
    small = metas["train"].max_token_id  # ids up to max_token_id occur: a model one smaller cannot embed them
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path / "bpe"), seq_len=16, batch_size=2)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=small, block_size=64))
    data.trainer = SimpleNamespace(lightning_module=model, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ValueError, match=rf"token id {small} but the model's vocab_size is {small}"):
        data.setup("fit")
