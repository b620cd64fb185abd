"""``kernels.torchao_fp8``: recipe names, which layers convert, the device check, the missing-extra error."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest
import torch

from lightning_perf.kernels import torchao_fp8


def test_recipe_names():
    assert torchao_fp8.normalize_fp8(False) is False and torchao_fp8.normalize_fp8(None) is False
    assert torchao_fp8.normalize_fp8(True) == "tensorwise"
    assert torchao_fp8.normalize_fp8("rowwise") == "rowwise"
    assert torchao_fp8.normalize_fp8("delayed") == "delayed"
    for bad in ("e4m3", 1, "Tensorwise"):
        with pytest.raises(ValueError, match="fp8 must be False, True"):
            torchao_fp8.normalize_fp8(bad)
    for recipe in ("rowwise", "delayed"):
        with pytest.raises(ValueError, match="FP8 all-gather needs the 'tensorwise' recipe"):
            torchao_fp8.fp8_linear_config(recipe, fsdp_all_gather=True)
    assert torchao_fp8.fp8_linear_config("tensorwise", fsdp_all_gather=True).enable_fsdp_float8_all_gather


def test_convert_skips_unaligned_and_excluded_layers_and_works_on_meta():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 20), torch.nn.Linear(20, 32),
                                  torch.nn.Linear(32, 32))
    weights = [m.weight for m in net]
    names = torchao_fp8.convert_to_fp8(net, "tensorwise", include=lambda layer, name: name != "3")
    assert names == ["0"]  # 48 -> 20 and 20 -> 32 are not multiples of 16; "3" excluded
    assert [torchao_fp8.fp8_recipe_of(m) for m in net] == ["tensorwise", None, None, None]
    assert all(m.weight is w for m, w in zip(net, weights))  # the same parameters
    assert torchao_fp8.convert_to_fp8(net, False) == []


def test_device_check_refuses_gpus_without_fp8(monkeypatch):
    torchao_fp8.check_fp8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*A100.*is 8.0: set fp8=False"):
        torchao_fp8.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    torchao_fp8.check_fp8_device(torch.device("cuda", 0))


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"lightning-perf\[fp8\]"):
        torchao_fp8.require_torchao()
    from lightning_perf.models import GPTLightningModule

    with pytest.raises(ImportError, match=r"lightning-perf\[fp8\]"):
        GPTLightningModule("tiny", config_overrides={"fp8": "rowwise"})
    assert not torchao_fp8.is_fp8_linear(torch.nn.Linear(16, 16))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_converted_model_copies_and_pickles(recipe):
    import copy
    import pickle

    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    torchao_fp8.convert_to_fp8(net, recipe)
    x = torch.randn(16, 32)
    net.eval()  # a delayed layer in eval mode records nothing: every call below sees the same history
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert type(clone[0]) is type(net[0]) and torchao_fp8.fp8_recipe_of(clone[0]) == recipe
        torch.testing.assert_close(clone(x), net(x), atol=0, rtol=0)


# ---- delayed scaling: the layer, its history as state ------------------------------------------


def _pair(K: int = 32, N: int = 48, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A delayed and a tensorwise FP8 linear with the same parameters."""
    torch.manual_seed(seed)
    delayed = torch.nn.Sequential(torch.nn.Linear(K, N))
    tensorwise = torch.nn.Sequential(torch.nn.Linear(K, N))
    tensorwise.load_state_dict(delayed.state_dict())
    assert torchao_fp8.convert_to_fp8(delayed, "delayed", amax_history=4) == ["0"]
    torchao_fp8.convert_to_fp8(tensorwise, "tensorwise")
    return delayed[0], tensorwise[0]


def test_delayed_layer_history_is_state_outside_the_state_dict():
    """The history is a non-persistent buffer: state dicts are the tensorwise layer's, and loading one
    empties it, so the next step falls back to the current amax (= the tensorwise layer's output)."""
    delayed, tensorwise = _pair()
    assert delayed.fp8_amax_history.shape == (3, 4) and not delayed.fp8_amax_history.any()
    assert list(delayed.state_dict()) == list(tensorwise.state_dict()) == ["weight", "bias"]
    assert torchao_fp8.fp8_recipe_of(delayed) == "delayed" and torchao_fp8.is_fp8_linear(delayed)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 32, generator=gen) * (1 + i) for i in range(3)]
    torch.testing.assert_close(delayed(xs[0]), tensorwise(xs[0]), atol=0, rtol=0)  # first call: current scaling
    for x in xs[1:]:
        delayed(x).sum().backward()
    # x and W recorded by three forwards, dL/dy by two backwards, newest first
    assert (delayed.fp8_amax_history[:2, :3] > 0).all() and delayed.fp8_amax_history[2].tolist() == [1, 1, 0, 0]
    assert not torch.equal(delayed(xs[0]), tensorwise(xs[0]))  # scales of the history (larger x seen)
    saved = {k: v.clone() for k, v in tensorwise.state_dict().items()}
    delayed.load_state_dict(saved)  # a tensorwise checkpoint loads into a delayed layer and vice versa
    assert not delayed.fp8_amax_history.any()
    torch.testing.assert_close(delayed(xs[0]), tensorwise(xs[0]), atol=0, rtol=0)
    tensorwise.load_state_dict(delayed.state_dict())
    assert torchao_fp8.reset_amax_history(torch.nn.Sequential(delayed, tensorwise)) == 1
    assert not delayed.fp8_amax_history.any()
    delayed.reset_parameters()  # a re-initialised layer starts with an empty history too
    assert not delayed.fp8_amax_history.any()


def test_delayed_layer_on_meta_and_its_errors():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(32, 48))
    torchao_fp8.convert_to_fp8(net, "delayed")
    assert net[0].fp8_amax_history.is_meta and net[0].fp8_amax_history.shape == (3, 16)
    net.to_empty(device="cpu")
    assert torchao_fp8.reset_amax_history(net) == 1 and not net[0].fp8_amax_history.any()
    assert torchao_fp8.uses_delayed_fp8(net) and not torchao_fp8.uses_delayed_fp8(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="amax_history must be a positive number of steps"):
        torchao_fp8.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32)), "delayed", amax_history=0)

    class Shard(torch.Tensor):
        """Stands for a DTensor or an FP8-gathered weight."""

    w = torch.Tensor._make_subclass(Shard, torch.randn(48, 32))
    with pytest.raises(ValueError, match=r"fp8='delayed' keeps an amax history for plain weights; .* Shard weight"):
        torchao_fp8.fp8_matmul(torch.randn(16, 32), w, net[0])


def test_delayed_layer_records_while_training_and_fp8_matmul_records_in_like():
    delayed, _ = _pair()
    x = torch.randn(16, 32)
    delayed.eval()
    delayed(x)
    assert not delayed.fp8_amax_history.any()  # evaluation reads the history, records nothing
    delayed.train()
    w = torch.cat([delayed.weight, 2 * delayed.weight])  # e.g. q, k, v weights by rows
    y = torchao_fp8.fp8_matmul(x, w, delayed)
    torch.testing.assert_close(y, torchao_fp8.fp8_linear_reference(x, w), atol=1e-5, rtol=1e-5)  # empty: current scales
    assert delayed.fp8_amax_history[0, 0] == x.abs().max()
    assert delayed.fp8_amax_history[1, 0] == w.abs().max()  # the matrix it multiplied


def _record(logger: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.WARNING, "__init__.py", 96, msg, args, None)


def test_torchao_import_noise_filter_drops_only_those_messages():
    noise = torchao_fp8.TorchaoImportNoise()
    so = "/venv/lib/python3.11/site-packages/torchao/"
    unloadable = "Could not load this library"
    mxfp8 = f"{so}_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    assert not noise.filter(_record("torchao", f"Failed to load {mxfp8}: {unloadable}"))
    assert not noise.filter(_record("torchao", f"Failed to load {so}_C_cutlass_90a.abi3.so: {unloadable}"))
    # torchao's core ops, its other warnings, and the same text on another logger stay
    assert noise.filter(_record("torchao", f"Failed to load {so}_C.abi3.so: undefined symbol"))
    assert noise.filter(_record("torchao", "Skipping import of cpp extensions due to incompatible torch version."))
    assert noise.filter(_record("my_project", f"Failed to load {so}_C_mxfp8.abi3.so: {unloadable}"))
    # torch's Enum-as-pytree-constant notice: for torchao's Enums only
    notice = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    theirs = enum.Enum("KernelPreference", "AUTO", module="torchao.quantization.quantize_.common.kernel_preference")
    mine = enum.Enum("Mode", "A", module="my_project.modes")
    assert not noise.filter(_record("torch.utils._pytree", notice, theirs))
    assert noise.filter(_record("torch.utils._pytree", notice, mine))
    assert noise.filter(_record("torch.utils._pytree", "some other pytree warning %s", theirs))


def test_importing_torchao_through_the_pack_is_quiet():
    """A fresh process (torchao's messages come once, from its first import): through ``require_torchao``
    neither torchao's extension-loading failures nor torch's Enum notice reach the user."""
    pytest.importorskip("torchao")
    noise = ("Failed to load", "KernelPreference")

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    quiet = run("from lightning_perf.kernels.torchao_fp8 import require_torchao; require_torchao()")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert not [n for n in noise if n in quiet.stdout + quiet.stderr], quiet.stderr[-3000:]
    raw = run("import torchao.float8")
    if not [n for n in noise if n in raw.stderr]:
        pytest.skip("this torchao build logs neither message on import: nothing to filter here")
