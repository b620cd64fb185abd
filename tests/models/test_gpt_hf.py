"""Hugging Face interop: the GPT built from tiny transformers checkpoints gives transformers' logits,
save_hf writes folders transformers loads back to the same logits, and bad checkpoints are refused."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lightning_perf.models import GPT, GPTConfig, GPTLightningModule  # noqa: E402
from lightning_perf.models.gpt.hf import config_from_hf, hf_config  # noqa: E402
from lightning_perf.models.gpt.model import rope_cache  # noqa: E402

VOCAB = 300
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _llama(**kw):
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=128, rope_theta=500000.0, tie_word_embeddings=False,
    )
    fields.update(kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))


def _gpt2(**kw):
    fields = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    fields.update(kw)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields))


def _qwen2():
    cfg = transformers.Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _mistral():
    cfg = transformers.MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=128, sliding_window=48,
    )
    return transformers.MistralForCausalLM(cfg)


MAKERS = {
    "llama": _llama,
    "llama3-scaling": lambda: _llama(rope_scaling=dict(LLAMA3_SCALING, rope_theta=500000.0)),
    "llama-bias-tied": lambda: _llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "gpt2": _gpt2,
    "qwen2": _qwen2,
    "mistral": _mistral,
}


def _save(model, path, **kw):
    torch.manual_seed(0)
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return path


def _hf_logits(model, idx):
    with torch.no_grad():
        return model.eval()(idx).logits


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_from_hf_matches_transformers_logits(kind, tmp_path):
    torch.manual_seed(0)
    hf = MAKERS[kind]().eval()
    path = _save(hf, tmp_path / kind)
    gpt = GPT.from_hf(path).eval()
    idx = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        ours = gpt(idx)
    assert ours.shape == (2, 40, VOCAB)  # the vocabulary is not padded on import
    torch.testing.assert_close(ours, _hf_logits(hf, idx), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "llama3-scaling", "gpt2", "qwen2"])
def test_save_hf_round_trip_loads_in_transformers(kind, tmp_path):
    torch.manual_seed(0)
    hf = MAKERS[kind]().eval()
    gpt = GPT.from_hf(_save(hf, tmp_path / "in")).eval()
    gpt.save_hf(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back) is type(hf)
    idx = torch.randint(0, VOCAB, (2, 33))
    torch.testing.assert_close(_hf_logits(back, idx), _hf_logits(hf, idx), atol=1e-5, rtol=1e-5)


def test_save_hf_from_random_init_loads_in_transformers(tmp_path):
    """A GPT trained here (random init, grouped-query, untied) exports to a Llama transformers runs."""
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny-llama", n_layer=2, n_embd=64, block_size=64, rope_theta=500000.0)
    gpt = GPT(cfg).eval()
    gpt.save_hf(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 50))
    with torch.no_grad():
        ours = gpt(idx)[..., : cfg.vocab_size]  # the GPT pads 260 -> 320 rows; the export drops the padding
    torch.testing.assert_close(_hf_logits(back, idx), ours, atol=1e-4, rtol=1e-4)
    assert back.config.vocab_size == 260 and back.model.embed_tokens.weight.shape == (260, 64)


def test_sharded_safetensors_load(tmp_path):
    torch.manual_seed(0)
    hf = _llama()
    path = _save(hf, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    gpt = GPT.from_hf(path).eval()
    idx = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx), _hf_logits(hf, idx), atol=1e-4, rtol=1e-4)


def test_pytorch_model_bin_loads(tmp_path):
    torch.manual_seed(0)
    hf = _gpt2()
    path = tmp_path / "bin"
    path.mkdir()
    hf.config.save_pretrained(str(path))
    torch.save(hf.state_dict(), path / "pytorch_model.bin")
    gpt = GPT.from_hf(path).eval()
    idx = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx), _hf_logits(hf, idx), atol=1e-4, rtol=1e-4)


def test_padded_vocabulary_rows_are_zero_and_dropped_on_save(tmp_path):
    torch.manual_seed(0)
    hf = _llama()
    path = _save(hf, tmp_path / "in")
    gpt = GPT.from_hf(path, pad_vocab_multiple=64).eval()
    assert gpt.tok_emb.weight.shape[0] == 320 and gpt.lm_head.weight.shape[0] == 320
    assert gpt.lm_head.weight[VOCAB:].abs().sum() == 0
    idx = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(gpt(idx)[..., :VOCAB], _hf_logits(hf, idx), atol=1e-4, rtol=1e-4)
    gpt.save_hf(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.lm_head.weight.shape == (VOCAB, 64)


def test_meta_init_then_init_weights_loads_the_checkpoint(tmp_path):
    """The path a sharding strategy takes: built on meta, materialised, then init_weights()."""
    torch.manual_seed(0)
    hf = _llama()
    path = _save(hf, tmp_path / "in")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        gpt = GPT(cfg, init_from_hf=str(path))
    gpt.to_empty(device="cpu")
    gpt.init_weights()
    idx = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(gpt.eval()(idx), _hf_logits(hf, idx), atol=1e-4, rtol=1e-4)


def test_lightning_module_from_hf_fine_tunes(tmp_path):
    torch.manual_seed(0)
    hf = _gpt2()
    path = _save(hf, tmp_path / "in")
    module = GPTLightningModule.from_hf(path, learning_rate=1e-3, warmup_steps=0)
    module.configure_model()
    assert module.config.n_embd == 32 and module.hparams.init_from_hf == str(path)
    idx = torch.randint(0, VOCAB, (2, 17))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        logits = _hf_logits(hf, x)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(module(x, y), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="either config='tiny' or init_from_hf"):
        GPTLightningModule("tiny", init_from_hf=str(path))


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=64,
        rope_scaling=dict(LLAMA3_SCALING, rope_theta=500000.0),
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    cos, sin = rope_cache(64, 128, 500000.0, torch.device("cpu"), LLAMA3_SCALING)
    expected = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq.float())
    torch.testing.assert_close(cos, expected.cos())
    torch.testing.assert_close(sin, expected.sin())
    plain_cos, _ = rope_cache(64, 128, 500000.0, torch.device("cpu"))
    assert (plain_cos - cos).abs().max() > 1e-2  # the scaling changes the low frequencies
    # the three bands by hand: head_dim 128 -> frequency i = theta^(-2i/128); wavelength 2*pi/f
    f = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    wavelen = 2 * math.pi / f
    long_ = wavelen > 16 / 1.0
    short = wavelen < 16 / 4.0
    torch.testing.assert_close(inv_freq.double()[long_], f[long_] / 8.0)
    torch.testing.assert_close(inv_freq.double()[short], f[short])


def test_unsupported_architecture_is_refused(tmp_path):
    path = _save(_gpt2(), tmp_path / "bad")
    hf = json.loads((path / "config.json").read_text())
    hf["architectures"], hf["model_type"] = ["BertForMaskedLM"], "bert"
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="BertForMaskedLM"):
        GPT.from_hf(path)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_scaling.rope_type"),
        ("head_dim", 32, "head_dim"),
    ],
)
def test_unsupported_config_fields_are_refused(field, value, named):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": VOCAB, field: value}
    with pytest.raises(ValueError, match=named):
        config_from_hf(hf)


def test_shape_mismatch_is_refused_with_both_names(tmp_path):
    path = _save(_llama(), tmp_path / "bad")
    hf = json.loads((path / "config.json").read_text())
    hf["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*blocks\.0\.mlp"):
        GPT.from_hf(path)


def test_unused_checkpoint_tensors_are_refused(tmp_path):
    path = _save(_llama(attention_bias=True, mlp_bias=True), tmp_path / "bad")
    hf = json.loads((path / "config.json").read_text())
    hf["attention_bias"] = hf["mlp_bias"] = False  # the file has biases the config says nothing of
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"no place for.*bias"):
        GPT.from_hf(path)


def test_gpt_without_hf_architecture_is_refused_on_save():
    cfg = GPTConfig.from_name("tiny", n_layer=1, positions="rope")
    with pytest.raises(ValueError, match="positions='rope'"):
        hf_config(cfg)


def test_a_shard_reads_only_its_elements(tmp_path, monkeypatch):
    from lightning_perf.models.gpt.hf import HFWeights, _read_box, weight_table

    path = _save(_gpt2(), tmp_path / "gpt2")
    full = GPT.from_hf(path, pad_vocab_multiple=64).state_dict()  # 300 rows padded to 320
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), pad_vocab_multiple=64)
    table = weight_table(cfg, "gpt2", prefix="transformer.")
    read: list[int] = []
    original = HFWeights.read
    monkeypatch.setattr(HFWeights, "read", lambda self, key, index: read.append(
        (t := original(self, key, index)).numel()) or t)
    monkeypatch.setattr(HFWeights, "get", lambda self, key: pytest.fail(f"{key} read whole"))
    weights = HFWeights(path)
    cases = [
        # (name, box, elements read): vocabulary rows past 300 are padding, never read
        ("tok_emb.weight", (slice(0, 160), slice(0, 32)), 160 * 32),
        ("tok_emb.weight", (slice(160, 320), slice(0, 32)), (300 - 160) * 32),
        ("tok_emb.weight", (slice(304, 320), slice(0, 32)), 0),
        ("tok_emb.weight", (slice(0, 320), slice(16, 32)), 300 * 16),
        # k of c_attn (stored (32, 96), transposed): rows 32..64 of the transpose, a column block of the file
        ("blocks.1.attn.k_proj.weight", (slice(16, 32), slice(0, 32)), 16 * 32),
        ("blocks.0.attn.v_proj.bias", (slice(0, 16),), 16),
        ("blocks.0.mlp.down_proj.weight", (slice(0, 32), slice(64, 128)), 32 * 64),
    ]
    for name, box, elements in cases:
        read.clear()
        assert torch.equal(_read_box(weights, table[name], cfg, box), full[name][box]), (name, box)
        assert read == [elements], (name, box, read)


def test_bad_input_is_refused_before_any_process_group(tmp_path):
    import torch.distributed as dist

    from lightning_perf.strategies import Parallel3DStrategy

    strategy = Parallel3DStrategy(tensor_parallel_size=2)  # never reached: the module refuses first
    path = _save(_llama(), tmp_path / "llama")
    with pytest.raises(ValueError, match=r"vocabulary mismatch: model\.embed_tokens\.weight has 300 rows .* 304"):
        GPTLightningModule.from_hf(path, vocab_size=VOCAB + 4)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(hf, intermediate_size=96)))
    with pytest.raises(ValueError, match=r"shape mismatch: model\.layers\.0\.mlp\.\w+_proj\.weight .* blocks\.0\.mlp"):
        GPTLightningModule.from_hf(path)
    (path / "config.json").write_text(json.dumps(dict(hf, architectures=["BertForMaskedLM"], model_type="bert")))
    with pytest.raises(ValueError, match=r"architectures=\['BertForMaskedLM'\]"):
        GPTLightningModule.from_hf(path)
    assert not dist.is_initialized() and strategy._parallel is None
