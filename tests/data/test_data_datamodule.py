"""TokenDataModule: batches, determinism, disjoint splits, data-parallel sharding, errors."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_perf.data import ByteTokenizer, ResumableDataLoader, ResumableSampler, TokenDataModule


def _batches(loader, n=None):
    out = []
    for i, batch in enumerate(loader):
        if n is not None and i == n:
            break
        out.append(batch)
    return out


def _fake_trainer(num_replicas: int, rank: int, global_rank: int | None = None, module=None):
    """Stands in for a Trainer whose strategy reports the data-parallel layout
    (tensor/pipeline strategies report the dp rank there, not the global rank)."""
    strategy = SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank},
        global_rank=rank if global_rank is None else global_rank,
        root_device=torch.device("cpu"),
    )
    return SimpleNamespace(strategy=strategy, lightning_module=module)


def test_contract_synthetic_batches():
    data = TokenDataModule(source="synthetic", vocab_size=320, seq_len=64, batch_size=8)
    assert data.vocab_size == 320
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(x.max()) < 320
    assert len(data.train_dataloader()) == 10_000 // 8


def test_contract_builtin_batches():
    data = TokenDataModule(source="builtin", seq_len=128, batch_size=8, builtin_max_bytes=1_000_000)
    assert data.vocab_size == ByteTokenizer.vocab_size == 260
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (8, 128) and x.dtype == torch.int64 and int(x.max()) < 260
    assert torch.equal(x[:, 1:], y[:, :-1])
    vx, vy = next(iter(data.val_dataloader()))
    assert vx.shape == (8, 128) and torch.equal(vx[:, 1:], vy[:, :-1])


@pytest.mark.parametrize("source", ["synthetic", "builtin"])
def test_same_seed_same_batches(source):
    kwargs = dict(source=source, seq_len=32, batch_size=4, seed=3, builtin_max_bytes=500_000)
    if source == "synthetic":
        kwargs["vocab_size"] = 100
    a, b, c = TokenDataModule(**kwargs), TokenDataModule(**kwargs), TokenDataModule(**{**kwargs, "seed": 4})
    for d in (a, b, c):
        d.setup("fit")
    ba, bb, bc = (_batches(d.train_dataloader(), 3) for d in (a, b, c))
    for (xa, ya), (xb, yb) in zip(ba, bb):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(ba[0][0], bc[0][0])
    # validation is never shuffled and is the same for every seed on the corpus
    va, vb = _batches(a.val_dataloader(), 2), _batches(b.val_dataloader(), 2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(va, vb))


def test_epochs_reshuffle_the_same_windows():
    data = TokenDataModule(source="synthetic", vocab_size=50, seq_len=8, batch_size=5, synthetic_train_samples=40)
    data.setup("fit")
    loader = data.train_dataloader()
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        epochs.append([tuple(row.tolist()) for x, _ in loader for row in x])
    assert len(epochs[0]) == len(set(epochs[0])) == 40
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
    no_shuffle = TokenDataModule(source="synthetic", vocab_size=50, seq_len=8, batch_size=5, synthetic_train_samples=40,
                                 shuffle=False)
    no_shuffle.setup("fit")
    rows = [tuple(r.tolist()) for x, _ in no_shuffle.train_dataloader() for r in x]
    assert rows == [tuple(no_shuffle.train_dataset[i][0].tolist()) for i in range(40)]


def test_train_and_val_are_disjoint():
    # builtin: split by file (the corpus test checks the file lists); here: no window in both
    data = TokenDataModule(source="builtin", seq_len=64, batch_size=16, builtin_max_bytes=500_000)
    data.setup("fit")
    train = {tuple(data.train_dataset[i][0].tolist()) for i in range(len(data.train_dataset))}
    val = {tuple(x.tolist()) for xb, _ in data.val_dataloader() for x in xb}
    assert val and not train & val
    synth = TokenDataModule(source="synthetic", vocab_size=1000, seq_len=16, synthetic_train_samples=500,
                            synthetic_val_samples=50)
    synth.setup("fit")
    t = {tuple(synth.train_dataset[i][0].tolist()) for i in range(500)}
    assert not t & {tuple(synth.val_dataset[i][0].tolist()) for i in range(50)}


@pytest.mark.parametrize("shuffle", [True, False])
def test_data_parallel_ranks_see_disjoint_halves(shuffle):
    seen = []
    for rank in range(2):
        # global rank 5 / 7: the sampler must follow the data-parallel rank, not the global one
        data = TokenDataModule(source="synthetic", vocab_size=97, seq_len=8, batch_size=3,
                               synthetic_train_samples=61, shuffle=shuffle)
        data.trainer = _fake_trainer(2, rank, global_rank=5 + 2 * rank)
        data.setup("fit")
        loader = data.train_dataloader()
        assert loader.sampler.num_replicas == 2 and loader.sampler.rank == rank
        assert len(loader) == (61 // 2) // 3 == 10
        ids = list(loader.sampler)
        assert len(ids) == 30
        rows = [tuple(r.tolist()) for x, _ in loader for r in x]
        assert rows == [tuple(data.train_dataset[i][0].tolist()) for i in ids]
        seen.append(ids)
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0]) | set(seen[1])) == 60  # 61 samples, one dropped so both ranks get 30
    # both halves interleave one global order: the same order a single process walks
    single = ResumableSampler(61, shuffle=shuffle, seed=1234)
    order = single.global_order().tolist()[:60]
    assert order[0::2] == seen[0] and order[1::2] == seen[1]


def test_single_process_when_the_strategy_has_no_sampler_kwargs():
    data = TokenDataModule(source="synthetic", vocab_size=10, seq_len=4, batch_size=2, synthetic_train_samples=10)
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), lightning_module=None)
    data.setup("fit")
    assert data.train_dataloader().sampler.num_replicas == 1


def test_lightning_keeps_our_loader(monkeypatch):
    """Under a distributed strategy Lightning swaps the sampler of a torch DataLoader for a
    DistributedSampler over the global ranks; ours is not a DataLoader and passes through
    untouched (Lightning's own code path, with the distributed condition forced on)."""
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    connector = trainer._data_connector
    monkeypatch.setattr(connector, "_requires_distributed_sampler", lambda dl: True)
    monkeypatch.setattr(
        connector, "_resolve_sampler", lambda dl, shuffle, mode=None: DistributedSampler(dl.dataset, 2, 0)
    )
    data = TokenDataModule(source="synthetic", vocab_size=10, seq_len=4, batch_size=2, synthetic_train_samples=10)
    data.setup("fit")
    plain = DataLoader(data.train_dataset, batch_size=2)
    replaced = connector._prepare_dataloader(plain, shuffle=True, mode=RunningStage.TRAINING)
    assert isinstance(replaced.sampler, DistributedSampler)  # the forced path is live
    loader = data.train_dataloader()
    assert connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING) is loader


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(source="hdf5"), ValueError, "unknown data source 'hdf5'; choose one of builtin, memmap, synthetic"),
        (dict(source="memmap"), ValueError, "needs data_dir"),
        (dict(source="builtin", vocab_size=256), ValueError, "vocab_size=256 is smaller than the byte tokenizer's 260"),
        (dict(source="builtin", seq_len=0), ValueError, "seq_len must be an integer >= 1, got 0"),
        (dict(source="builtin", batch_size=-2), ValueError, "batch_size"),
        (dict(source="synthetic", vocab_size=0), ValueError, "vocab_size"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        TokenDataModule(**kwargs)


def test_errors_at_setup():
    tiny = TokenDataModule(source="synthetic", vocab_size=10, seq_len=4, batch_size=32, synthetic_train_samples=10)
    tiny.setup("fit")
    with pytest.raises(ValueError, match="fewer than batch_size=32"):
        tiny.train_dataloader()
    long = TokenDataModule(source="builtin", seq_len=10_000_000, builtin_max_bytes=200_000)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        long.setup("fit")
    # checked against the model when the Trainer knows it
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=200, block_size=64))
    data = TokenDataModule(source="builtin", seq_len=32)
    data.trainer = _fake_trainer(1, 0, module=model)
    with pytest.raises(ValueError, match=r"model's vocab_size \(200\) is smaller than the builtin data's \(260\)"):
        data.setup("fit")
    model.config.vocab_size = 320
    data = TokenDataModule(source="builtin", seq_len=128)
    data.trainer = _fake_trainer(1, 0, module=model)
    with pytest.raises(ValueError, match="seq_len=128 is longer than the model's block_size=64"):
        data.setup("fit")


def test_synthetic_without_vocab_size_needs_a_model_at_setup():
    data = TokenDataModule(source="synthetic", seq_len=4, batch_size=2, synthetic_train_samples=10)
    hint = r"source='synthetic' has no vocab_size: pass vocab_size, or attach .* config\.vocab_size"
    with pytest.raises(ValueError, match=hint + ".*setup\(\) has not run"):
        _ = data.vocab_size
    with pytest.raises(ValueError, match=hint + ".*no Trainer with such a model is attached"):
        data.setup("fit")
    for module in (None, SimpleNamespace(), SimpleNamespace(config=SimpleNamespace(block_size=8))):
        data.trainer = _fake_trainer(1, 0, module=module)
        with pytest.raises(ValueError, match=hint):
            data.setup("fit")
    assert data.train_dataset is None
    data.trainer = _fake_trainer(1, 0, module=SimpleNamespace(config=SimpleNamespace(vocab_size=37, block_size=8)))
    data.setup("fit")
    assert data.vocab_size == data.data_vocab_size() == data.train_dataset.vocab_size == 37
    assert int(torch.cat([x for x, _ in data.train_dataloader()]).max()) < 37
    # an explicit vocab_size is still checked against the model's
    data = TokenDataModule(source="synthetic", vocab_size=300, seq_len=4, batch_size=2, synthetic_train_samples=10)
    data.trainer = _fake_trainer(1, 0, module=SimpleNamespace(config=SimpleNamespace(vocab_size=260, block_size=8)))
    with pytest.raises(ValueError, match=r"model's vocab_size \(260\) is smaller than the synthetic data's \(300\)"):
        data.setup("fit")


def test_synthetic_takes_the_vocabulary_of_the_model_in_a_trainer():
    from lightning.pytorch.callbacks import Callback

    from lightning_perf.models.gpt.module import GPTLightningModule

    class Batches(Callback):
        def __init__(self):
            self.inputs = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.inputs.append(batch[0].clone())

    model = GPTLightningModule("tiny-llama", vocab_size=97, block_size=16, warmup_steps=1)
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=4, synthetic_train_samples=32,
                           synthetic_val_samples=4)
    seen = Batches()
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
              callbacks=[seen]).fit(model, data)
    assert data.requested_vocab_size is None and data.vocab_size == model.config.vocab_size == 97
    assert data.train_dataset.vocab_size == data.val_dataset.vocab_size == 97
    ids = torch.cat(seen.inputs)
    assert len(seen.inputs) == 2 and ids.shape == (8, 16)
    assert 0 <= int(ids.min()) and int(ids.max()) < 97


def test_loader_rejects_a_foreign_state():
    data = TokenDataModule(source="synthetic", vocab_size=10, seq_len=4, batch_size=2, synthetic_train_samples=20)
    data.setup("fit")
    loader: ResumableDataLoader = data.train_dataloader()
    state = loader.state_dict()
    with pytest.raises(ValueError, match="num_samples=30"):
        loader.load_state_dict({**state, "num_samples": 30})
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({**state, "seed": 1})
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict({**state, "version": 0})


def _loader(num_samples, batch_size, num_replicas=1, rank=0, seed=5):
    sampler = ResumableSampler(num_samples, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    dataset = torch.arange(num_samples)  # sample i is i
    return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler)


def test_loader_state_round_trip_without_a_trainer():
    reference = _loader(30, 4)
    full = [b.tolist() for b in reference]
    assert sum(full, []) == reference.sampler.global_order().tolist()[:28]  # 7 batches, last 2 dropped
    first = _loader(30, 4)
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, 12)
    second = _loader(30, 4)
    second.load_state_dict(state)
    assert second.state_dict()["consumed"] == 12  # a checkpoint taken before iterating keeps the position
    assert head + [b.tolist() for b in second] == full
    # the position is used once: the next epoch starts from its beginning
    second.sampler.set_epoch(1)
    assert len([b for b in second]) == len(second) == 7


def test_resume_with_a_different_data_parallel_size_covers_the_epoch_once():
    """The position is counted in the global order, so 2 ranks -> 1 rank after a restart
    still sees every remaining sample exactly once (with a warning only when batches
    cannot be re-cut at the same boundary)."""
    ranks = [_loader(40, 3, num_replicas=2, rank=r) for r in range(2)]
    iters = [iter(loader) for loader in ranks]
    before = [x for it in iters for _ in range(2) for x in next(it).tolist()]
    assert len(before) == 12
    state = ranks[0].state_dict()
    assert state["consumed"] == 12 == ranks[1].state_dict()["consumed"]
    single = _loader(40, 4, num_replicas=1)
    single.load_state_dict(state)
    after = [x for b in single for x in b.tolist()]
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(40))
    assert after == single.sampler.global_order().tolist()[12:]
    # batch 5 cannot restart at sample 12 on a batch boundary: warned, still no repeats
    recut = _loader(40, 5, num_replicas=1)
    recut.load_state_dict(state)
    with pytest.warns(UserWarning, match="not a multiple of batch_size"):
        after = [x for b in recut for x in b.tolist()]
    assert after == recut.sampler.global_order().tolist()[12:37]
