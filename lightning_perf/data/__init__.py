"""Token data: a byte tokenizer, memmap / built-in / synthetic datasets, a resumable
loader and the ``TokenDataModule`` that puts them behind Lightning."""

from lightning_perf.data.builtin import StdlibCorpus, build_stdlib_corpus
from lightning_perf.data.datamodule import TokenDataModule
from lightning_perf.data.datasets import SyntheticTokenDataset, TokenWindowDataset
from lightning_perf.data.documents import DocumentBoundaries
from lightning_perf.data.hf_tokenizer import HFTokenizer, load_tokenizer
from lightning_perf.data.loader import ResumableDataLoader, ResumableSampler
from lightning_perf.data.memmap import MemmapTokenDataset, TokenFileMeta, read_token_file, write_token_file
from lightning_perf.data.prepare import prepare
from lightning_perf.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DocumentBoundaries",
    "HFTokenizer",
    "MemmapTokenDataset",
    "ResumableDataLoader",
    "ResumableSampler",
    "StdlibCorpus",
    "SyntheticTokenDataset",
    "TokenDataModule",
    "TokenFileMeta",
    "TokenWindowDataset",
    "build_stdlib_corpus",
    "load_tokenizer",
    "prepare",
    "read_token_file",
    "write_token_file",
]
