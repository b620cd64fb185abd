"""ZeRO-3 on 2 gloo ranks: a GPT built on meta, sharded, then filled from a Hugging Face folder (each rank
reads its own shards) gives transformers' logits; save_hf and a sharded checkpoint converted back to a
Hugging Face folder both hold the original tensors exactly."""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from _spawn import spawn  # noqa: E402

VOCAB = 301  # odd: the embedding and head rows shard unevenly over 2 ranks


def _worker(rank: int, world: int, out_dir: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_perf.kernels.dtensor import is_dtensor
    from lightning_perf.models import GPT
    from lightning_perf.models.gpt.hf import config_from_hf, read_hf_config
    from lightning_perf.parallel.checkpointing.checkpoint import save_checkpoint
    from lightning_perf.parallel.sharding.fsdp import apply_fsdp
    from lightning_perf.parallel.sharding.init import materialize_local

    path = out_dir / "hf"
    cfg = config_from_hf(read_hf_config(path))
    with torch.device("meta"):
        gpt = GPT(cfg, init_from_hf=str(path))
    apply_fsdp(gpt, init_device_mesh("cpu", (world,)), reshard_after_forward=True)
    materialize_local(gpt, torch.device("cpu"))  # init_weights() on the shards: reads this rank's slices
    sharded = all(is_dtensor(p) for p in gpt.parameters())
    local_rows = gpt.tok_emb.weight.to_local().shape[0]
    idx = torch.load(out_dir / "idx.pt")
    with torch.no_grad():
        logits = gpt(idx)
    gpt.save_hf(out_dir / "saved")  # gathers the shards; rank 0 writes
    save_checkpoint(out_dir / "ckpt", gpt)
    return {"logits": logits, "sharded": sharded, "local_rows": local_rows}


@pytest.mark.slow
def test_zero3_meta_init_from_hf_and_back(tmp_path):
    from lightning_perf.models.gpt.convert import checkpoint_to_hf
    from lightning_perf.models.gpt.hf import config_from_hf, read_hf_config

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=64, rope_theta=500000.0, tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    idx = torch.randint(0, VOCAB, (2, 24))
    torch.save(idx, tmp_path / "idx.pt")
    with torch.no_grad():
        expected = hf(idx).logits

    results = spawn(_worker, 2, tmp_path, timeout=180.0, init_group=True)
    assert [r["local_rows"] for r in results] == [151, 150]
    for r in results:
        assert r["sharded"]
        torch.testing.assert_close(r["logits"], expected, atol=1e-4, rtol=1e-4)

    original = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    cfg = config_from_hf(read_hf_config(tmp_path / "hf"))
    checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "converted", config=cfg)  # consolidated in memory
    for folder in ("saved", "converted"):
        written = safetensors_torch.load_file(str(tmp_path / folder / "model.safetensors"))
        assert written.keys() == original.keys(), folder
        for key, tensor in original.items():
            assert torch.equal(written[key], tensor), f"{folder}: {key}"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, expected, atol=1e-5, rtol=1e-5)
