"""MFUMonitor and PerfReport on packed documents: attention FLOPs counted per document, by hand."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from callback_toys import ListLogger, ToyLM, V, VirtualClock, trainer
from torch.utils.data import DataLoader, Dataset

from lightning_perf.callbacks import MFUMonitor, PerfReport, SyncPointWarner
from lightning_perf.perf import steps
from lightning_perf.perf.documents import document_attention_flops, document_lengths

STEP = 0.25  # virtual seconds of every training step
T = 16
ROW = [0] * 4 + [1] * 4 + [2] * 8  # documents of 4, 4 and 8 tokens: sum L**2 = 96


@pytest.fixture
def fake_clock(monkeypatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(steps, "host_clock", clock)
    return clock


class PackedTokens(Dataset):
    """(inputs, targets, doc_ids) rows of T tokens, every row split as ``row``."""

    def __init__(self, row: list[int] = ROW, n: int = 32) -> None:
        self.data = torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(0))
        self.doc_ids = torch.tensor(row, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:], self.doc_ids


class Plain(PackedTokens):
    def __getitem__(self, i: int):
        return super().__getitem__(i)[:2]


class ToyWithAttention(ToyLM):
    """Declares FLOPs per token 1000 + 10 T, of which A(T) = 10 T is attention (linear in T, as causal
    attention is); hardware 1200 + 12 T with 12 T attention; 1000 + 20 T with attention over the full square."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)

    def flops_per_token(self, seq_len=None) -> int:
        return 1000 + 10 * seq_len

    def attention_flops_per_token(self, seq_len=None) -> int:
        return 10 * seq_len

    def hardware_flops_per_token(self, seq_len=None) -> int:
        return 1200 + 12 * seq_len

    def hardware_attention_flops_per_token(self, seq_len=None) -> int:
        return 12 * seq_len

    def flops_per_token_full_attention(self, seq_len=None) -> int:
        return 1000 + 20 * seq_len


def fit(tmp_path, clock, dataset, module=None, B=4, steps_=4, callbacks=()):
    mon = MFUMonitor(peak_flops=1e9, warmup_steps=1, window=2)
    tr = trainer(tmp_path, [mon, *callbacks], max_steps=steps_)
    tr.fit(module or ToyWithAttention(STEP, clock), DataLoader(dataset, batch_size=B))
    return mon, tr


def test_packed_mfu_equals_the_hand_count(tmp_path, fake_clock):
    """Rows of 4 + 4 + 8 tokens: per row 1000 x 16 + 10 x (16 + 16 + 64) model FLOPs, in place of
    1000 x 16 + 10 x 16 x 16 for one causal sequence; a fake 0.25 s step and a 1 GFLOP/s peak."""
    B, peak = 4, 1e9
    mon, tr = fit(tmp_path, fake_clock, PackedTokens(), B=B)
    row, row_hw, row_full = 1000 * 16 + 10 * 96, 1200 * 16 + 12 * 96, 1000 * 16 + 20 * 96
    assert row == 16_960
    last = mon.history[-1]
    assert last.mfu == pytest.approx(B * row / STEP / peak)
    assert last.hfu == pytest.approx(B * row_hw / STEP / peak)
    assert mon.run_window().attention_flops == pytest.approx(3 * B * 10 * 96)  # steps 1-3
    s = mon.summary()
    assert s["mfu_full_attention"] == pytest.approx(B * row_full / STEP / peak)
    assert s["attention"].startswith("counted per document")
    assert s["mean_document_tokens"] == pytest.approx(16 / 3)
    metrics = tr.callback_metrics
    assert metrics["perf/mfu"].item() == pytest.approx(B * row / STEP / peak)
    assert metrics["perf/mean_document_tokens"].item() == pytest.approx(16 / 3)


def test_unpacked_batches_are_unchanged(tmp_path, fake_clock):
    """The same module on (inputs, targets): the whole causal row, 1000 + 10 x 16 per token, and no
    per-document statement; rows that are one document each give the same numbers."""
    B, peak = 4, 1e9
    plain, tr = fit(tmp_path, fake_clock, Plain(), B=B)
    assert plain.history[-1].mfu == pytest.approx(B * T * (1000 + 10 * T) / STEP / peak)
    assert plain.summary()["mfu_full_attention"] == pytest.approx(B * T * (1000 + 20 * T) / STEP / peak)
    assert plain.summary()["attention"] is None and plain.summary()["mean_document_tokens"] is None
    assert "perf/mean_document_tokens" not in tr.callback_metrics
    one_doc, _ = fit(tmp_path, fake_clock, PackedTokens([0] * T), B=B)
    assert one_doc.history[-1].mfu == pytest.approx(plain.history[-1].mfu)
    assert one_doc.history[-1].hfu == pytest.approx(plain.history[-1].hfu)
    assert one_doc.summary()["mfu_full_attention"] == pytest.approx(plain.summary()["mfu_full_attention"])


def test_a_module_without_its_attention_part_keeps_the_whole_row(tmp_path, fake_clock):
    class NoSplit(ToyWithAttention):
        attention_flops_per_token = None

    with pytest.warns(UserWarning, match="counted over whole rows"):
        mon, _ = fit(tmp_path, fake_clock, PackedTokens(), module=NoSplit(STEP, fake_clock))
    assert mon.history[-1].mfu == pytest.approx(4 * T * (1000 + 10 * T) / STEP / 1e9)
    assert mon.summary()["attention"].startswith("counted over whole rows")


class Batches(L.Callback):
    """The doc_ids of every batch, as the step saw them (host tensors on a CPU run)."""

    def __init__(self) -> None:
        self.doc_ids: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.doc_ids.append(batch[2].clone())


def test_packed_gpt_fit_logs_mfu_per_document(tmp_path):
    """A tiny GPT fit on token files of short documents with pack_documents=True: the window's model FLOPs
    are the hand count from the batches' document lengths (GPTConfig's 6N per token + 6 L d L_i per token
    of each document), the report says attention was counted per document, and the count adds no sync
    site of the pack."""
    import numpy as np

    from lightning_perf.data import ByteTokenizer, TokenDataModule, write_token_file
    from lightning_perf.models import GPTLightningModule

    rng = np.random.default_rng(0)
    docs = [np.concatenate([[ByteTokenizer.bos_id], rng.integers(0, 256, n - 2), [ByteTokenizer.eos_id]])
            for n in rng.integers(4, 40, 200)]
    stream = np.concatenate(docs)
    write_token_file(tmp_path / "train", stream, vocab_size=ByteTokenizer.vocab_size)
    write_token_file(tmp_path / "val", stream[:200], vocab_size=ByteTokenizer.vocab_size)
    seq, B = 64, 2
    module = GPTLightningModule("tiny", vocab_size=260, block_size=seq)
    data = TokenDataModule(source="memmap", data_dir=str(tmp_path), seq_len=seq, batch_size=B,
                           pack_documents=True, shuffle=False)
    mon, report, seen = MFUMonitor(peak_flops=1e12, window=2), PerfReport(print_report=False), Batches()
    warner = SyncPointWarner(every_n_steps=0, start_step=5)  # watches the step that reads step 4's documents
    logger = ListLogger()
    tr = trainer(tmp_path, [seen, mon, report, warner], max_steps=6, limit_val_batches=0, logger=logger)
    tr.fit(module, data)

    cfg = module.config
    dense = 6 * cfg.num_params(include_embedding=False)
    hand = [sum(dense * sum(r) + document_attention_flops(r, attention_flops_per_token=cfg.attention_flops_per_token).model
                for r in document_lengths(d)) for d in seen.doc_ids]
    window = mon.run_window()
    assert (window.first, window.last, window.steps) == (2, 4, 3)  # step 5 sampled by the warner
    assert window.flops == pytest.approx(sum(hand[2:5]))
    assert sum(hand[2:5]) < 3 * B * seq * cfg.flops_per_token(seq)  # less than the whole causal rows
    # Lightning's ThroughputMonitor reads flops_per_batch: the last batch, attention per document too
    assert module.flops_per_batch == pytest.approx(hand[-1], rel=1e-12)
    assert module.flops_per_batch < B * seq * cfg.flops_per_token(seq)
    assert mon.summary()["mfu"] == pytest.approx(window.flops / window.seconds / 1e12)
    assert logger.values("perf/mfu")[-1] == pytest.approx(mon.summary()["mfu"])  # the final figures logged
    assert logger.values("perf/mean_document_tokens")[-1] == pytest.approx(mon.mean_document_tokens)
    assert mon.mean_document_tokens < seq / 2
    s = report.summary
    assert s.mfu == mon.summary()["mfu"]
    assert s.attention.startswith("counted per document")
    assert "| attention FLOPs | counted per document" in (tmp_path / "perf_report.md").read_text()
    ours = ("perf/documents.py", "callbacks/mfu.py", "callbacks/report.py")
    assert not [x.describe() for x in warner.framework_sites() if x.location.split(":")[0].endswith(ours)]


def test_counted_flops_on_packed_batches(tmp_path):
    """Without flops_per_token the forward is counted once: the document-masked attention op counts the
    full square, and the monitor replaces it by the per-document count. A tiny GPT (L = 4, d = 256) on rows
    of 4 + 4 + 8 does 6 L d (T**2 - 96) fewer FLOPs per row than on causal rows of 16."""
    from lightning_perf.models import GPT, GPTConfig

    class Counted(L.LightningModule):  # declares no FLOPs: the monitor counts the forward
        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPT(GPTConfig.from_name("tiny", vocab_size=260, block_size=T))

        def training_step(self, batch, batch_idx):
            return self.gpt(*batch[:2], doc_ids=batch[2] if len(batch) == 3 else None)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    B, per_step = 2, {}
    for name, ds in (("packed", PackedTokens()), ("causal", Plain())):
        mon = MFUMonitor(peak_flops=1e12, warmup_steps=0, window=1)
        trainer(tmp_path, [mon], max_steps=4).fit(Counted(),
                                                  DataLoader(ds, batch_size=B))
        window = mon.run_window()
        assert window.steps == 3  # step 0 ran the count
        per_step[name] = window.flops / window.steps
        squares = B * (96 if name == "packed" else T * T)
        assert window.attention_flops == pytest.approx(3 * 6 * 4 * 256 * squares)
    assert per_step["causal"] - per_step["packed"] == pytest.approx(6 * 4 * 256 * B * (T * T - 96))
