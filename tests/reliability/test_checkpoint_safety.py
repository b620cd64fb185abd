"""A checkpoint is data: a planted pickle payload is refused on every load path and never runs.

The payload is an object whose ``__reduce__`` runs a shell command creating a marker file (what the
issue demonstrated). It is planted where each path reads a pickle, with the size / CRC-32 manifest in
``extra.pt`` recomputed so the integrity check passes, as an attacker would:

- the DCP ``.metadata`` (which torch's own reader unpickles with plain ``pickle.load``);
- a non-tensor entry of the shards (which torch's default load planner reads with
  ``weights_only=False``): the metadata declares a model tensor as bytes stored in a new file;
- ``extra.pt``, a Lightning ``.ckpt`` file, a Hugging Face ``pytorch_model.bin``.

For each, every load path of the pack refuses it with an error naming the file and the class, and
the marker does not exist; then torch's unguarded reader runs on the same file and the marker
appears, so each payload is live and the test could fail. Also: the allow-list admits what torch
writes (dtypes, layouts, paths) and nothing beyond it, and a data file name leading out of the
checkpoint is refused.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _crc32(path: Path) -> int:
    return zlib.crc32(path.read_bytes())


def _recompute_manifest(ckpt: Path) -> None:
    """What an attacker does after editing files: sizes and CRC-32 recorded again."""
    blob = torch.load(ckpt / "extra.pt", weights_only=True)
    blob["files"] = {f.name: [f.stat().st_size, _crc32(f)] for f in ckpt.iterdir()
                     if f.is_file() and f.name != "extra.pt"}
    torch.save(blob, ckpt / "extra.pt")


def _trusted_metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, untampered file


def plant_in_metadata(ckpt: Path, marker: Path) -> None:
    md = _trusted_metadata(ckpt)
    md.planner_data = {**(md.planner_data or {}), "note": _Payload(marker)}
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _recompute_manifest(ckpt)


def plant_as_bytes_entry(ckpt: Path, marker: Path) -> str:
    """The first model tensor becomes a "bytes" entry whose data is the pickled payload; returns its key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = _trusted_metadata(ckpt)
    fqn = next(k for k in md.state_dict_metadata if k.startswith("model."))
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != fqn}
    data = ckpt / "__9_0.distcp"
    torch.save({"w": _Payload(marker)}, data)
    md.storage_data[MetadataIndex(fqn)] = _StorageInfo(data.name, 0, data.stat().st_size)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _recompute_manifest(ckpt)
    return fqn


def plant_in_extra(ckpt: Path, marker: Path) -> None:
    blob = torch.load(ckpt / "extra.pt", weights_only=True)
    blob["extra"] = {"note": _Payload(marker)}
    torch.save(blob, ckpt / "extra.pt")


def torch_reads_metadata(ckpt: Path) -> None:
    """torch's own reader, unguarded (the control)."""
    import torch.distributed.checkpoint as dcp

    dcp.FileSystemReader(str(ckpt)).read_metadata()


def torch_reads_bytes_entry(ckpt: Path, fqn: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({fqn: torch.empty(0)}, checkpoint_id=str(ckpt), no_dist=True)


# ---- a small checkpoint: load_checkpoint --------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    from lightning_perf.parallel.checkpointing.checkpoint import save_checkpoint

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("small") / "step1"
    save_checkpoint(path, model, [opt], extra={"step": 1})
    return path


def _load_small(path: Path, **kwargs):
    from lightning_perf.parallel.checkpointing.checkpoint import load_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        return load_checkpoint(path, model, [torch.optim.AdamW(model.parameters())], **kwargs)
    except Exception:
        for k, v in model.state_dict().items():  # a refused load leaves the model untouched
            assert torch.equal(v, before[k]), k
        raise


def test_load_checkpoint_refuses_a_payload_in_the_metadata(small, tmp_path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint_io import UnsafeCheckpointError

    ckpt, marker = tmp_path / "c", tmp_path / "pwned"
    shutil.copytree(small, ckpt)
    plant_in_metadata(ckpt, marker)
    for kwargs in ({}, {"verify": False}, {"weights_only": False}):
        with pytest.raises(UnsafeCheckpointError, match=rf"{ckpt / '.metadata'}: refused to unpickle posix.system"):
            with pytest.warns(UserWarning) if kwargs else _no_warning():
                _load_small(ckpt, **kwargs)
        assert not marker.exists()
    torch_reads_metadata(ckpt)  # the control: torch's reader runs it
    assert marker.exists()


def test_load_checkpoint_refuses_a_payload_in_a_non_tensor_entry(small, tmp_path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint_io import UnsafeCheckpointError

    ckpt, marker = tmp_path / "c", tmp_path / "pwned"
    shutil.copytree(small, ckpt)
    fqn = plant_as_bytes_entry(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"__9_0.distcp: refused to unpickle posix.system in the entry "
                                                    rf"'{fqn}'"):
        _load_small(ckpt)
    assert not marker.exists()
    torch_reads_bytes_entry(ckpt, fqn)
    assert marker.exists()


def test_load_checkpoint_refuses_a_payload_in_extra(small, tmp_path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint_io import UnsafeCheckpointError

    ckpt, marker = tmp_path / "c", tmp_path / "pwned"
    shutil.copytree(small, ckpt)
    plant_in_extra(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"{ckpt / 'extra.pt'}: refused to unpickle posix.system"):
        _load_small(ckpt)
    assert not marker.exists()
    torch.load(ckpt / "extra.pt", weights_only=False)
    assert marker.exists()


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_unverified_loads_say_so(small, tmp_path) -> None:
    ckpt = tmp_path / "c"
    shutil.copytree(small, ckpt)
    with _no_warning():
        assert _load_small(ckpt) == {"step": 1}  # verified: no warning
    with pytest.warns(UserWarning, match=r"not checked against their saved sizes and CRC-32 \(verify=False\)"):
        assert _load_small(ckpt, verify=False) == {"step": 1}
    with pytest.warns(UserWarning, match=r"unpickled with weights_only=False"):
        assert _load_small(ckpt, weights_only=False) == {"step": 1}
    blob = torch.load(ckpt / "extra.pt", weights_only=True)
    del blob["files"]
    torch.save(blob, ckpt / "extra.pt")
    with pytest.warns(UserWarning, match=r"saved without a file manifest"):
        assert _load_small(ckpt) == {"step": 1}


def test_the_allow_list_admits_what_torch_writes_and_nothing_else(tmp_path) -> None:
    """dtypes, a layout, torch.Size and the path DCP records all resolve; a near miss does not."""
    import io

    from lightning_perf.parallel.checkpointing.checkpoint import load_checkpoint, save_checkpoint
    from lightning_perf.parallel.checkpointing.checkpoint_io import (
        METADATA_GLOBALS,
        MetadataUnpickler,
        UnsafeCheckpointError,
    )

    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16)
    model.register_buffer("count", torch.arange(3))
    model.register_buffer("z", torch.zeros(2, dtype=torch.complex64))
    save_checkpoint(tmp_path / "c", model)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16)
    other.register_buffer("count", torch.zeros(3, dtype=torch.long))
    other.register_buffer("z", torch.ones(2, dtype=torch.complex64))
    load_checkpoint(tmp_path / "c", other)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    for module, name in [("torch", "load"), ("builtins", "eval"), ("torch.distributed.checkpoint.metadata", "torch"),
                         ("pathlib", "Path.touch"), ("torch.serialization", "load"), ("os", "system")]:
        assert (module, name) not in METADATA_GLOBALS
        data = f"c{module}\n{name}\n.".encode()  # protocol 0: GLOBAL module name, STOP
        with pytest.raises(UnsafeCheckpointError, match=rf"x.metadata: refused to unpickle {module}.{name}"):
            MetadataUnpickler(io.BytesIO(data), source="x.metadata").load()


def test_a_data_file_outside_the_checkpoint_is_refused(small, tmp_path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint_io import UnsafeCheckpointError

    ckpt = tmp_path / "c"
    shutil.copytree(small, ckpt)
    md = _trusted_metadata(ckpt)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../secret"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _recompute_manifest(ckpt)
    with pytest.raises(UnsafeCheckpointError, match=r"names the data file '../secret'"):
        _load_small(ckpt)


# ---- a GPT checkpoint of a strategy: resume, consolidate, convert, generate, HF import ------------


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """ZeroStrategy (one process) saves a GPT checkpoint every 2 steps, ``last.ckpt`` among them."""
    import lightning as L
    from _harness import data, make_module, trainer

    from lightning_perf.strategies import ZeroStrategy

    root = tmp_path_factory.mktemp("gpt")
    L.seed_everything(0, verbose=False)
    trainer(ZeroStrategy(stage=2), 1, steps=2, ckpt_dir=root / "ckpt").fit(make_module(), data(4, 1, 16))
    yield root / "ckpt" / "last.ckpt"
    if dist.is_initialized():
        dist.destroy_process_group()


def _resume(ckpt: Path) -> int:
    import lightning as L
    from _harness import data, make_module, trainer

    from lightning_perf.strategies import ZeroStrategy

    L.seed_everything(0, verbose=False)
    t = trainer(ZeroStrategy(stage=2), 1, steps=3)
    t.fit(make_module(), data(4, 1, 16), ckpt_path=str(ckpt))
    return t.global_step


@pytest.mark.parametrize("where", ["metadata", "bytes_entry", "extra"])
def test_resume_through_the_strategy_refuses_a_payload(gpt_run, tmp_path, where: str) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint_io import UnsafeCheckpointError

    ckpt, marker = tmp_path / "last.ckpt", tmp_path / "pwned"
    shutil.copytree(gpt_run, ckpt)
    assert _resume(ckpt) == 3  # intact: it resumes
    fqn = None
    if where == "metadata":
        plant_in_metadata(ckpt, marker)
    elif where == "bytes_entry":
        fqn = plant_as_bytes_entry(ckpt, marker)
    else:
        plant_in_extra(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle posix.system"):
        _resume(ckpt)
    assert not marker.exists()
    if where == "metadata":
        torch_reads_metadata(ckpt)
    elif where == "bytes_entry":
        torch_reads_bytes_entry(ckpt, fqn)
    else:
        torch.load(ckpt / "extra.pt", weights_only=False)
    assert marker.exists()


def _refused(call, marker: Path, file: Path, capsys) -> None:
    """Refused with an error (or, from a command, an exit and a message) naming the file and the class."""
    from lightning_perf.parallel.checkpointing.checkpoint_io import UnsafeCheckpointError

    capsys.readouterr()
    with pytest.raises((UnsafeCheckpointError, SystemExit)) as info:
        call()
    text = f"{info.value}\n{capsys.readouterr().err}"
    assert f"{file}" in text and "posix.system" in text, text
    assert not marker.exists()


def test_consolidate_and_convert_refuse_a_payload(gpt_run, tmp_path, capsys) -> None:
    from lightning_perf.cli import main

    ckpt, marker = tmp_path / "last.ckpt", tmp_path / "pwned"
    shutil.copytree(gpt_run, ckpt)
    main(["consolidate", str(ckpt), str(tmp_path / "ok.pt")])  # intact: it consolidates
    intact = torch.load(tmp_path / "ok.pt", weights_only=True)
    plant_in_metadata(ckpt, marker)
    file = ckpt / ".metadata"
    _refused(lambda: main(["consolidate", "--ckpt_dir", str(ckpt), "--out", str(tmp_path / "m.pt")]), marker, file,
             capsys)
    assert not (tmp_path / "m.pt").exists()
    _refused(lambda: main(["convert", "--to_hf", str(ckpt), "--out", str(tmp_path / "hf")]), marker, file, capsys)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    torch_reads_metadata(ckpt)
    assert marker.exists()

    # a planted non-tensor entry: consolidation reads model tensors only, so it is never unpickled
    shutil.rmtree(ckpt)
    marker.unlink()
    shutil.copytree(gpt_run, ckpt)
    fqn = plant_as_bytes_entry(ckpt, marker)
    main(["consolidate", str(ckpt), str(tmp_path / "m.pt")])
    assert not marker.exists()
    left = torch.load(tmp_path / "m.pt", weights_only=True)
    assert len(left) == len(intact) - 1 and all(torch.equal(v, intact[k]) for k, v in left.items())
    torch_reads_bytes_entry(ckpt, fqn)
    assert marker.exists()


def test_generate_convert_and_hf_import_refuse_a_payload_in_a_file(tmp_path, capsys) -> None:
    """A Lightning .ckpt (generate, convert --to_hf) and a Hugging Face pytorch_model.bin (generate,
    convert --from_hf, GPTLightningModule.from_hf)."""
    pytest.importorskip("safetensors")
    from lightning_perf.cli import main
    from lightning_perf.models import GPTLightningModule

    marker = tmp_path / "pwned"
    ckpt_file = tmp_path / "m.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"config": _Payload(marker)}}, ckpt_file)
    _refused(lambda: main(["generate", "--ckpt_path", str(ckpt_file), "--device", "cpu"]), marker, ckpt_file, capsys)
    _refused(lambda: main(["convert", "--to_hf", str(ckpt_file), "--out", str(tmp_path / "o")]), marker, ckpt_file,
             capsys)

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    llama = GPTLightningModule("tiny-llama", config_overrides={"n_layer": 1, "n_embd": 32, "block_size": 16})
    llama.save_hf(hf)
    GPTLightningModule.from_hf(hf).configure_model()  # intact: it imports
    (hf / "model.safetensors").unlink()
    torch.save({"lm_head.weight": _Payload(marker)}, hf / "pytorch_model.bin")
    binary = hf / "pytorch_model.bin"
    _refused(lambda: main(["generate", "--ckpt_path", str(hf), "--device", "cpu"]), marker, binary, capsys)
    _refused(lambda: main(["convert", "--from_hf", str(hf), "--out", str(tmp_path / "x.ckpt")]), marker, binary, capsys)
    _refused(lambda: GPTLightningModule.from_hf(hf).configure_model(), marker, binary, capsys)
    torch.load(ckpt_file, weights_only=False)  # the control
    assert marker.exists()
