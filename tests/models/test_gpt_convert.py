"""``lightning-perf convert`` and ``generate`` with Hugging Face folders: each direction keeps the logits."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lightning_perf.cli import load_module, main  # noqa: E402
from lightning_perf.models import GPT, GPTConfig, GPTLightningModule  # noqa: E402

VOCAB = 300


def _hf_gpt2(path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    hf = transformers.GPT2LMHeadModel(cfg)
    hf.save_pretrained(str(path), safe_serialization=True)
    return hf.eval()


def _logits(model, idx):
    with torch.no_grad():
        out = model.eval()(idx)
    return out.logits if hasattr(out, "logits") else out


def test_convert_from_hf_writes_a_checkpoint_generate_loads(tmp_path, capsys):
    hf = _hf_gpt2(tmp_path / "hf")
    main(["convert", "--from_hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m.ckpt")])
    module = load_module(str(tmp_path / "m.ckpt"))
    idx = torch.randint(0, VOCAB, (1, 24))
    torch.testing.assert_close(_logits(module, idx), _logits(hf, idx), atol=1e-4, rtol=1e-4)
    capsys.readouterr()
    main(["generate", "--ckpt_path", str(tmp_path / "m.ckpt"), "--prompt", "hi", "--max_new_tokens", "4",
          "--temperature", "0", "--device", "cpu"])
    assert capsys.readouterr().out.startswith("hi")  # byte ids: the prompt comes back, then the new tokens


def test_convert_to_hf_from_lightning_checkpoint(tmp_path):
    hf = _hf_gpt2(tmp_path / "hf")
    main(["convert", "--from_hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m.ckpt")])
    main(["convert", "--to_hf", str(tmp_path / "m.ckpt"), "--out", str(tmp_path / "back")])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    idx = torch.randint(0, VOCAB, (1, 24))
    torch.testing.assert_close(_logits(back, idx), _logits(hf, idx), atol=1e-5, rtol=1e-5)


def test_convert_to_hf_from_sharded_and_consolidated_checkpoints(tmp_path):
    from lightning_perf.parallel.checkpointing.checkpoint import consolidate, save_checkpoint

    torch.manual_seed(0)
    module = GPTLightningModule("tiny-llama", config_overrides={"n_layer": 2, "n_embd": 64, "block_size": 32})
    module.configure_model()
    save_checkpoint(tmp_path / "sharded", module, extra={"hyper_parameters": dict(module.hparams)})
    main(["convert", "--to_hf", str(tmp_path / "sharded"), "--out", str(tmp_path / "hf1")])
    consolidate(tmp_path / "sharded", tmp_path / "model.pt")
    # the config recorded beside the consolidated file (model.pt.json)
    main(["convert", "--to_hf", str(tmp_path / "model.pt"), "--out", str(tmp_path / "hf3")])
    (tmp_path / "model.pt.json").unlink()
    with pytest.raises(SystemExit):  # a bare state dict names no config
        main(["convert", "--to_hf", str(tmp_path / "model.pt"), "--out", str(tmp_path / "hf2")])
    cfg = GPTConfig(**module.hparams["config"])
    from lightning_perf.models.gpt.convert import checkpoint_to_hf

    checkpoint_to_hf(tmp_path / "model.pt", tmp_path / "hf2", config=cfg)
    idx = torch.randint(0, 260, (1, 20))
    expected = _logits(module, idx)[..., :260]
    for folder in ("hf1", "hf2", "hf3"):
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / folder))
        torch.testing.assert_close(_logits(back, idx), expected, atol=1e-4, rtol=1e-4)


def test_generate_from_a_hf_folder_uses_its_tokenizer(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 3,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    cfg = GPTConfig.from_name("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=tok.get_vocab_size(), block_size=32)
    GPT(cfg).save_hf(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    capsys.readouterr()
    main(["generate", "--ckpt_path", str(tmp_path / "hf"), "--prompt", "the fox", "--max_new_tokens", "3",
          "--temperature", "0", "--device", "cpu"])
    out = capsys.readouterr().out.strip()
    assert out.startswith(tok.decode(tok.encode("the fox").ids))
