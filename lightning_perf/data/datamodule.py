"""``TokenDataModule``: the Lightning side of the token datasets.

Thin: the datasets (``datasets.py``, ``memmap.py``, ``builtin.py``) and the resumable
loader (``loader.py``) hold the logic. Three sources:

- ``"builtin"``: the Python standard library's sources, byte-tokenized (vocab 260);
- ``"memmap"``: ``train.bin`` / ``val.bin`` token files in ``data_dir`` (see ``prepare``);
- ``"synthetic"``: uniform random tokens of ``vocab_size``, or of the model's vocabulary
  (benchmarks).

Batches are ``(inputs, targets)``, int64 tensors of shape ``(batch_size, seq_len)``. With
``pack_documents=True`` they are ``(inputs, targets, doc_ids)``: ``doc_ids`` (batch_size, seq_len)
int32 numbers the documents inside each window (from the tokenizer's ``<eos>`` / ``<bos>``; see
``documents.py``), and the target of each document's last token is -100 (ignored by the loss)
unless ``cross_document_targets=True``. ``GPTLightningModule`` passes ``doc_ids`` to the model, whose
attention is then document-causal and whose positions restart at each document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_perf.data.builtin import DEFAULT_MAX_BYTES, build_stdlib_corpus
from lightning_perf.data.datasets import SyntheticTokenDataset, TokenWindowDataset
from lightning_perf.data.documents import DocumentBoundaries
from lightning_perf.data.loader import ResumableDataLoader, ResumableSampler
from lightning_perf.data.memmap import MemmapTokenDataset, read_meta, read_token_file, scan_max_token_id
from lightning_perf.data.tokenizer import TOKENIZERS, ByteTokenizer

__all__ = ["SOURCES", "TokenDataModule"]

SOURCES = ("builtin", "memmap", "synthetic")
_SYNTHETIC_VOCAB_HINT = (
    "source='synthetic' has no vocab_size: pass vocab_size, or attach the data module to a model with a"
    " config.vocab_size (e.g. trainer.fit(model, data)), whose vocabulary setup() then uses"
)


class TokenDataModule(L.LightningDataModule):
    """Fixed-length next-token windows from one of three sources.

    Every epoch visits every training window once in a permutation seeded by
    ``seed + epoch``; the position within the epoch is saved in Lightning checkpoints,
    so a run resumed mid-epoch continues with the next unseen batch. Under a
    distributed strategy the data is split by the strategy's data-parallel rank
    (``strategy.distributed_sampler_kwargs``), not by the global rank.

    ``setup`` checks the data against the model before building anything: the model's
    vocabulary must cover the data's, ``seq_len`` must fit its ``block_size``, and for
    ``"memmap"`` the largest id of each token file (``max_token_id`` in its metadata, or
    one scan of the file when the metadata lacks it) must lie below both vocabularies.

    Args:
        source: ``"builtin"``, ``"memmap"`` or ``"synthetic"``.
        data_dir: directory with ``train.bin``/``val.bin`` (+ ``.json``), for ``"memmap"``.
        vocab_size: for ``"synthetic"``, the range of the tokens; ``None`` takes the
            ``config.vocab_size`` of the Trainer's LightningModule at ``setup``. For the
            others, optional: the model's vocabulary, checked to be >= the data's.
            The :attr:`vocab_size` property reports what the model needs.
        seq_len: tokens per sample (each sample reads ``seq_len + 1``).
        batch_size: samples per batch (micro-batch) on each data-parallel rank; ``"auto"``: the memory
            planner's choice for the GPU the run is on (``lightning_perf.runtime.planning``), the fastest that
            fits, logged once at the start of the fit.
        num_workers: loader worker processes.
        pin_memory: ``None`` pins when the Trainer runs on CUDA.
        seed: shuffle seed (and the synthetic data's seed).
        synthetic_train_samples, synthetic_val_samples: sizes of the synthetic splits.
        builtin_max_bytes: cap on the stdlib source bytes read for ``"builtin"``.
        shuffle: shuffle the training windows each epoch.
        pack_documents: samples are ``(inputs, targets, doc_ids)``: the documents inside each window,
            for document-causal attention (``"builtin"`` and ``"memmap"``; synthetic tokens have none).
        cross_document_targets: with ``pack_documents``, keep the target of each document's last
            token (the next document's first token); by default it is ignored by the loss.
        global_batch_size, global_batch_tokens: the global batch of one optimizer step, in sequences or in
            tokens, over every data-parallel rank and accumulated micro-batch. The Trainer's
            ``accumulate_grad_batches`` then follows from it and the micro-batch (unless given > 1 explicitly).
        global_batch_per_gpus: the global batch above is for this many GPUs; a run on N GPUs scales it by
            N / global_batch_per_gpus (the same tokens per GPU per step on any number of GPUs).

    Example::

        data = TokenDataModule(source="synthetic", vocab_size=320, seq_len=64, batch_size=8)
        data = TokenDataModule(source="synthetic", seq_len=64)  # the model's vocabulary, at setup
        data = TokenDataModule(source="builtin", seq_len=128, batch_size=8)
        data = TokenDataModule(source="builtin", seq_len=2048, pack_documents=True)
    """

    def __init__(
        self,
        source: Literal["builtin", "memmap", "synthetic"] = "builtin",
        data_dir: str | None = None,
        vocab_size: int | None = None,
        seq_len: int = 256,
        batch_size: int | Literal["auto"] = 8,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 1234,
        synthetic_train_samples: int = 10_000,
        synthetic_val_samples: int = 64,
        builtin_max_bytes: int = DEFAULT_MAX_BYTES,
        shuffle: bool = True,
        pack_documents: bool = False,
        cross_document_targets: bool = False,
        global_batch_size: int | None = None,
        global_batch_tokens: int | None = None,
        global_batch_per_gpus: int | None = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
        if batch_size != "auto" and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                     or batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1 or 'auto', got {batch_size!r}")
        if global_batch_size is not None and global_batch_tokens is not None:
            raise ValueError("give the global batch once: global_batch_size (sequences) or global_batch_tokens")
        for name, value in (("global_batch_size", global_batch_size), ("global_batch_tokens", global_batch_tokens),
                            ("global_batch_per_gpus", global_batch_per_gpus)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if global_batch_tokens is not None and global_batch_tokens % seq_len:
            raise ValueError(f"global_batch_tokens={global_batch_tokens} is not a whole number of seq_len={seq_len} "
                             f"sequences: use a multiple of {seq_len}")
        if global_batch_per_gpus is not None and global_batch_size is None and global_batch_tokens is None:
            raise ValueError("global_batch_per_gpus scales a global batch: give global_batch_size or "
                             "global_batch_tokens with it")
        for name, value, low in (
            ("seq_len", seq_len, 1),
            ("num_workers", num_workers, 0),
            ("seed", seed, 0),
            ("synthetic_train_samples", synthetic_train_samples, 1),
            ("synthetic_val_samples", synthetic_val_samples, 1),
            ("builtin_max_bytes", builtin_max_bytes, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if source == "builtin" and vocab_size is not None and vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the byte tokenizer's {ByteTokenizer.vocab_size}"
                " (256 bytes + 4 special tokens) used by the built-in corpus"
            )
        if pack_documents and source == "synthetic":
            raise ValueError(
                "pack_documents=True needs documents: source='synthetic' is uniform random tokens with no"
                " <eos>; use source='builtin' or 'memmap'"
            )
        if source == "memmap" and data_dir is None:
            raise ValueError("source='memmap' needs data_dir: a directory with train.bin/val.bin from `prepare`")
        self.save_hyperparameters()
        self.source = source
        self.data_dir = None if data_dir is None else Path(data_dir)
        self.requested_vocab_size = vocab_size
        self._model_vocab_for_synthetic: int | None = None  # set by setup() when vocab_size is None
        self._max_token_ids: dict[str, int | None] = {}  # per memmap split, once known
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.global_batch_tokens = global_batch_tokens
        self.global_batch_per_gpus = global_batch_per_gpus
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.synthetic_train_samples = synthetic_train_samples
        self.synthetic_val_samples = synthetic_val_samples
        self.builtin_max_bytes = builtin_max_bytes
        self.shuffle = shuffle
        self.pack_documents = pack_documents
        self.cross_document_targets = cross_document_targets
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    # ------------------------------------------------------------------ vocab
    def data_vocab_size(self) -> int:
        """Largest token id + 1 that the data can contain (reads the memmap metadata).

        For ``"synthetic"`` without ``vocab_size`` this is known once ``setup`` has taken
        the model's vocabulary; before that it raises ``ValueError``.
        """
        if self.source == "synthetic":
            vocab = self.requested_vocab_size or self._model_vocab_for_synthetic
            if vocab is None:
                raise ValueError(_SYNTHETIC_VOCAB_HINT + "; setup() has not run with such a model yet")
            return vocab
        if self.source == "builtin":
            return ByteTokenizer.vocab_size
        assert self.data_dir is not None
        return max(read_meta(self.data_dir / split).vocab_size for split in ("train", "val"))

    @property
    def vocab_size(self) -> int:
        """The vocabulary the model needs: ``vocab_size`` if given (validated to cover
        the data), else the data's own (see :meth:`data_vocab_size`)."""
        data_vocab = self.data_vocab_size()
        if self.requested_vocab_size is None:
            return data_vocab
        if self.requested_vocab_size < data_vocab:
            raise ValueError(
                f"vocab_size={self.requested_vocab_size} is smaller than the vocabulary of the {self.source}"
                f" data ({data_vocab}); token ids up to {data_vocab - 1} would index past the embedding"
            )
        return self.requested_vocab_size

    def _model_vocab_size(self) -> int | None:
        """``config.vocab_size`` of the attached Trainer's LightningModule, if there is one."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        vocab = getattr(getattr(module, "config", None), "vocab_size", None)
        return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, stage: str) -> None:
        synthetic_unresolved = self.requested_vocab_size is None and self._model_vocab_for_synthetic is None
        if self.source == "synthetic" and synthetic_unresolved:
            model_vocab = self._model_vocab_size()
            if model_vocab is None:
                raise ValueError(_SYNTHETIC_VOCAB_HINT + "; no Trainer with such a model is attached")
            self._model_vocab_for_synthetic = model_vocab
        if self.source == "memmap":
            self._check_data_dir()
        vocab = self.vocab_size  # validates files / vocabulary before anything is built
        if self.source == "memmap":
            self._check_tokenizer(getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None)
            self._check_token_ids(self._model_vocab_size())
        self._check_against_model(vocab)
        if self.train_dataset is not None:
            return
        if self.source == "synthetic":
            self.train_dataset = SyntheticTokenDataset(
                vocab, self.seq_len, self.synthetic_train_samples, seed=self.seed, stream=0
            )
            self.val_dataset = SyntheticTokenDataset(vocab, self.seq_len, self.synthetic_val_samples, seed=self.seed, stream=1)
        elif self.source == "builtin":
            corpus = build_stdlib_corpus(self.builtin_max_bytes)
            docs = self.document_boundaries()
            self.train_dataset = TokenWindowDataset(
                corpus.train_tokens, self.seq_len, name="builtin corpus (train)", documents=docs
            )
            self.val_dataset = TokenWindowDataset(
                corpus.val_tokens, self.seq_len, name="builtin corpus (val)", documents=docs
            )
        else:
            assert self.data_dir is not None
            docs = self.document_boundaries()
            self.train_dataset = MemmapTokenDataset(self.data_dir / "train", self.seq_len, documents=docs)
            self.val_dataset = MemmapTokenDataset(self.data_dir / "val", self.seq_len, documents=docs)
        for split, ds in (("train", self.train_dataset), ("val", self.val_dataset)):
            if split == "val" and stage == "fit" and self._validation_disabled():
                continue  # the Trainer never asks for the validation loader
            if len(ds) == 0:  # type: ignore[arg-type]
                skip = " (or disable validation with limit_val_batches=0)" if split == "val" and stage == "fit" else ""
                raise ValueError(
                    f"the {split} split of the {self.source} data ({ds!r}) has fewer than seq_len + 1 ="
                    f" {self.seq_len + 1} tokens: lower seq_len or provide more data{skip}"
                )

    def _validation_disabled(self) -> bool:
        """Whether the attached Trainer runs no validation (``limit_val_batches=0``)."""
        return self._trainer_attached() and getattr(self.trainer, "limit_val_batches", None) == 0

    def _check_data_dir(self) -> None:
        assert self.data_dir is not None
        if not self.data_dir.is_dir():
            raise FileNotFoundError(
                f"data_dir {self.data_dir} does not exist: create it with `lightning-perf prepare --input"
                f" <text files or dirs> --out_dir {self.data_dir}`, or point data_dir at such a directory"
            )

    def document_boundaries(self) -> DocumentBoundaries | None:
        """How samples find their documents (the tokenizer's ``<eos>`` / ``<bos>`` ids), or None
        without ``pack_documents``. For ``"memmap"`` the tokenizer is the one the metadata names."""
        if not self.pack_documents:
            return None
        tokenizer = ByteTokenizer
        if self.source == "memmap":
            assert self.data_dir is not None
            names = {read_meta(self.data_dir / split).tokenizer for split in ("train", "val")}
            unknown = sorted(names - set(TOKENIZERS))
            if unknown or len(names) != 1:
                raise ValueError(
                    f"pack_documents=True needs the <eos> id of the token files' tokenizer; {self.data_dir} names"
                    f" {sorted(names)}, known: {sorted(TOKENIZERS)} (one tokenizer for both splits)"
                )
            tokenizer = TOKENIZERS[names.pop()]
        return DocumentBoundaries(
            eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id, cross_document_targets=self.cross_document_targets
        )

    def _check_token_ids(self, model_vocab: int | None) -> None:
        """Largest id of each token file below its metadata's vocabulary and the model's,
        so a bad file fails here and not when its first bad sample is read."""
        assert self.data_dir is not None
        for split in ("train", "val"):
            bin_path, meta_path = self.data_dir / f"{split}.bin", self.data_dir / f"{split}.json"
            if split not in self._max_token_ids:
                meta = read_meta(self.data_dir / split)  # a recorded max_token_id is checked here
                max_id = meta.max_token_id
                if max_id is None and meta.num_tokens:
                    max_id = scan_max_token_id(read_token_file(self.data_dir / split)[0])
                    assert max_id is not None
                    if max_id >= meta.vocab_size:
                        raise ValueError(
                            f"{bin_path} holds token id {max_id} but {meta_path} says vocab_size is"
                            f" {meta.vocab_size}: the file is corrupted or its metadata is wrong"
                        )
                    rank_zero_warn(
                        f"{meta_path} records no max_token_id, so {bin_path} was scanned for its"
                        f" largest id ({max_id}); re-run `lightning-perf prepare` to record it and skip the scan"
                    )
                self._max_token_ids[split] = max_id
            max_id = self._max_token_ids[split]
            if max_id is not None and model_vocab is not None and max_id >= model_vocab:
                raise ValueError(
                    f"{bin_path} holds token id {max_id} but the model's vocab_size is {model_vocab}:"
                    f" build the model with vocab_size >= {max_id + 1}"
                )

    def _check_against_model(self, vocab: int) -> None:
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        config = getattr(module, "config", None)
        model_vocab = self._model_vocab_size()
        if model_vocab is not None and model_vocab < self.data_vocab_size():
            raise ValueError(
                f"the model's vocab_size ({model_vocab}) is smaller than the {self.source} data's"
                f" ({self.data_vocab_size()}): build the model with vocab_size >= {self.data_vocab_size()}"
            )
        block_size = getattr(config, "block_size", None)
        if isinstance(block_size, int) and self.seq_len > block_size:
            raise ValueError(f"seq_len={self.seq_len} is longer than the model's block_size={block_size}")

    def _check_tokenizer(self, module: Any) -> None:
        """Memmap data made by another tokenizer than the one the model's checkpoint ships is refused:
        the ids would mean other tokens. A model states its tokenizer as ``tokenizer_hash`` (e.g. the
        hash of the ``tokenizer.json`` beside the Hugging Face weights it was imported from)."""
        model_hash = getattr(module, "tokenizer_hash", None)
        if self.source != "memmap" or not isinstance(model_hash, str):
            return
        assert self.data_dir is not None
        for split in ("train", "val"):
            meta = read_meta(self.data_dir / split)
            if meta.tokenizer_hash != model_hash:
                made_by = f"{meta.tokenizer} (hash {meta.tokenizer_hash})" if meta.tokenizer_hash else meta.tokenizer
                raise ValueError(
                    f"{self.data_dir / split}.bin was tokenized by {made_by}, but the model's checkpoint ships "
                    f"another tokenizer (tokenizer.json hash {model_hash}); re-run `lightning-perf prepare "
                    f"--tokenizer <the model's folder>` so the ids mean the tokens the model learnt"
                )

    def _trainer_attached(self) -> bool:
        return self.trainer is not None

    def _replicas(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of data parallelism from the strategy, else ``(1, 0)``."""
        if not self._trainer_attached():
            return 1, 0
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        num_replicas, rank = int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
        return max(num_replicas, 1), rank

    def _pin(self) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        if self._trainer_attached():
            return self.trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

    def _loader(self, dataset: Dataset | None, *, train: bool) -> ResumableDataLoader:
        if dataset is None:
            raise RuntimeError("TokenDataModule.setup() must run before the dataloaders are requested")
        num_replicas, rank = self._replicas()
        sampler = ResumableSampler(
            len(dataset),  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=self.shuffle and train,
            seed=self.seed,
        )
        if train and len(sampler) < self.batch_size:
            raise ValueError(
                f"the train split has {len(sampler)} samples of seq_len={self.seq_len} per data-parallel rank"
                f" ({len(dataset)} in all over {num_replicas} rank(s)), fewer than batch_size={self.batch_size}"  # type: ignore[arg-type]
            )
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=train,
            num_workers=self.num_workers,
            pin_memory=self._pin(),
            persistent_workers=train and self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        return self._loader(self.train_dataset, train=True)

    @override
    def val_dataloader(self) -> ResumableDataLoader:
        return self._loader(self.val_dataset, train=False)

    @override
    def test_dataloader(self) -> ResumableDataLoader:
        """The validation split (there is no separate test split)."""
        return self._loader(self.val_dataset, train=False)
