"""The GPT on packed documents: a packed row equals its documents run alone (positions restart,
attention stays inside each document), the loss skips cross-document targets, and the Lightning
module takes (inputs, targets, doc_ids) batches beside the plain ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_perf.models import GPT, GPTConfig, GPTLightningModule

LENGTHS = [7, 1, 12, 5]  # a one-token document too
T = sum(LENGTHS)


def _doc_ids() -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENGTHS)])[None]


def _model(positions: str, attention: str) -> GPT:
    cfg = GPTConfig.from_name("tiny").replace(vocab_size=100, block_size=32, positions=positions, attention=attention)
    torch.manual_seed(0)
    return GPT(cfg).eval()


def _alone(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    outs, start = [], 0
    for n in LENGTHS:
        outs.append(model(idx[:, start:start + n]))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("attention", ["sdpa", "auto", "flex"])
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_packed_logits_equal_each_document_alone(positions, attention):
    model = _model(positions, attention)
    idx = torch.randint(0, 100, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed, alone = model(idx, doc_ids=_doc_ids()), _alone(model, idx)
        plain = model(idx)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (plain[:, LENGTHS[0]:] - alone[:, LENGTHS[0]:]).abs().max() > 1e-3  # without doc_ids they differ


def test_loss_skips_cross_document_targets():
    """The packed loss is the mean cross-entropy of each document's own next tokens, from logits of the
    documents run alone; targets crossing into the next document (-100) count nowhere."""
    model = _model("rope", "sdpa")
    gen = torch.Generator().manual_seed(2)
    idx, nxt = torch.randint(0, 100, (1, T), generator=gen), torch.randint(0, 100, (1, T), generator=gen)
    doc_ids = _doc_ids()
    last = torch.zeros(T, dtype=torch.bool)
    last[torch.tensor(LENGTHS).cumsum(0) - 1] = True
    targets = torch.where(last, torch.full_like(nxt, -100), nxt)
    with torch.no_grad():
        loss = model(idx, targets, doc_ids=doc_ids)
        logits = _alone(model, idx)[0, ~last]
        expected = F.cross_entropy(logits.float(), nxt[0, ~last])
    assert int((~last).sum()) == T - len(LENGTHS)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_module_takes_packed_dict_and_plain_batches():
    module = GPTLightningModule("tiny", vocab_size=100, block_size=32)
    module.configure_model()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 100, (2, T), generator=gen), torch.randint(0, 100, (2, T), generator=gen)
    doc_ids = _doc_ids().expand(2, T).contiguous()
    with torch.no_grad():
        packed = module.validation_step((x, y, doc_ids), 0)
        as_dict = module.validation_step({"inputs": x, "targets": y, "doc_ids": doc_ids}, 0)
        plain = module.validation_step((x, y), 0)
        expected = module.model(x, y, doc_ids=doc_ids)
    assert torch.equal(packed, expected) and torch.equal(as_dict, expected)
    assert not torch.allclose(plain, packed)
    with pytest.raises(ValueError, match="doc_ids"):
        module.validation_step((x,), 0)



def test_global_positions_equal_the_default_and_do_not_combine_with_doc_ids():
    # context parallelism passes the tokens' global positions (T,); 0..T-1 is the default
    model = _model("rope", "sdpa")
    idx = torch.randint(0, 100, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(idx, positions=torch.arange(T)), model(idx))
        with pytest.raises(ValueError, match="not supported under context parallelism"):
            model(idx, doc_ids=_doc_ids(), positions=torch.arange(T))
