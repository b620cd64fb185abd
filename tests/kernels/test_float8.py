"""``kernels.float8``: recipe names, which layers convert, the device check, the missing-extra error."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_perf.kernels import float8


def test_recipe_names():
    assert float8.normalize_fp8(False) is False and float8.normalize_fp8(None) is False
    assert float8.normalize_fp8(True) == "tensorwise"
    assert float8.normalize_fp8("rowwise") == "rowwise"
    for bad in ("e4m3", 1, "Tensorwise"):
        with pytest.raises(ValueError, match="fp8 must be False, True"):
            float8.normalize_fp8(bad)
    with pytest.raises(ValueError, match="FP8 all-gather needs the 'tensorwise' recipe"):
        float8.fp8_linear_config("rowwise", fsdp_all_gather=True)
    assert float8.fp8_linear_config("tensorwise", fsdp_all_gather=True).enable_fsdp_float8_all_gather


def test_convert_skips_unaligned_and_excluded_layers_and_works_on_meta():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 20), torch.nn.Linear(20, 32),
                                  torch.nn.Linear(32, 32))
    weights = [m.weight for m in net]
    names = float8.convert_to_fp8(net, "tensorwise", include=lambda layer, name: name != "3")
    assert names == ["0"]  # 48 -> 20 and 20 -> 32 are not multiples of 16; "3" excluded
    assert [float8.fp8_recipe_of(m) for m in net] == ["tensorwise", None, None, None]
    assert all(m.weight is w for m, w in zip(net, weights))  # the same parameters
    assert float8.convert_to_fp8(net, False) == []


def test_device_check_refuses_gpus_without_fp8(monkeypatch):
    float8.check_fp8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*A100.*is 8.0: set fp8=False"):
        float8.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_fp8_device(torch.device("cuda", 0))


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"lightning-perf\[fp8\]"):
        float8.require_torchao()
    from lightning_perf.models import GPTLightningModule

    with pytest.raises(ImportError, match=r"lightning-perf\[fp8\]"):
        GPTLightningModule("tiny", config_overrides={"fp8": "rowwise"})
    assert not float8.is_fp8_linear(torch.nn.Linear(16, 16))


def test_converted_model_copies_and_pickles():
    import copy
    import pickle

    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    float8.convert_to_fp8(net, "tensorwise")
    x = torch.randn(16, 32)
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert type(clone[0]) is type(net[0]) and float8.fp8_recipe_of(clone[0]) == "tensorwise"
        torch.testing.assert_close(clone(x), net(x), atol=0, rtol=0)
