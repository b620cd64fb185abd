"""Sync kinds without a GPU: the op classifier, the detector plan per device, and the CUDA detector's
composition, with CUDA's sync debug mode played by a stand-in that warns as the real one does
(a warning at the line of the op, after the op ran)."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch

from lightning_perf.perf.sync import (
    CudaSyncCatcher,
    DispatchSyncDetector,
    SyncCallCatcher,
    SyncRecorder,
    SyncWatch,
    classify_op,
    detector_plan,
    find_site,
)

aten = torch.ops.aten

# A warning raised from C++ has no Python frame of its own: it lands at the line that called the op.
# A function compiled under a "<...>" file name is skipped by the site search in the same way.
debug_mode_warns = eval(compile(
    "lambda: __import__('warnings').warn('Warning: called a synchronizing CUDA operation', UserWarning)",
    "<cuda>", "eval"))


def _line(marker: str) -> str:
    with open(__file__) as f:
        n = next(i for i, text in enumerate(f, 1) if f"# {marker}" in text)
    return f"{__file__}:{n}"


@pytest.fixture
def fake_debug_mode(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    return modes


def _kinds(rec: SyncRecorder) -> dict[str, tuple[str, int]]:
    return {s.location: (s.kind, s.count) for s in rec.sites.values()}


def test_detector_plan_per_device():
    assert detector_plan("auto", "cuda") == (True, "copies", False)  # debug mode + light dispatch check
    assert detector_plan("auto", "cpu") == (False, "full", True)  # host tensors stand in for device ones
    assert detector_plan("both", "cuda") == (True, "full", False)
    assert detector_plan("dispatch", "cuda") == (False, "full", False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        detector_plan("cuda", "cpu")
    with pytest.raises(ValueError, match="detector must be one of"):
        detector_plan("sometimes", "cuda")


def test_classify_copies_by_direction_and_memory():
    host, dev = torch.ones(4), torch.ones(4, device="meta")  # "meta" stands in for the device
    pageable = classify_op(aten._to_copy.default, (host,), {"device": torch.device("meta"), "non_blocking": True})
    assert pageable.kind == "pageable_h2d" and not pageable.debug_mode_sees
    assert classify_op(aten._to_copy.default, (host,), {"device": torch.device("meta")}).kind == "h2d_copy"
    assert classify_op(aten._to_copy.default, (dev,), {"device": torch.device("cpu")}).kind == "d2h_copy"
    # a non-blocking _to_copy to the host pins its own output: asynchronous
    assert classify_op(aten._to_copy.default, (dev,), {"device": torch.device("cpu"), "non_blocking": True}) is None
    # copy_ takes non_blocking positionally; into pageable host memory it is synchronous anyway
    assert classify_op(aten.copy_.default, (dev, host, True), {}).kind == "pageable_h2d"
    into_pageable = classify_op(aten.copy_.default, (host, dev, True), {})
    assert into_pageable.kind == "d2h_copy" and not into_pageable.debug_mode_sees
    assert classify_op(aten._to_copy.default, (host,), {"dtype": torch.half}) is None  # no transfer


def test_classify_scalar_and_data_dependent_ops():
    host, dev = torch.ones(4), torch.ones(4, device="meta")
    mask = torch.ones(4, dtype=torch.bool, device="meta")
    assert classify_op(aten._local_scalar_dense.default, (dev,), {}).kind == "scalar"
    assert classify_op(aten._local_scalar_dense.default, (host,), {}) is None  # a host value on a GPU run
    assert classify_op(aten._local_scalar_dense.default, (host,), {}, emulate_host=True).kind == "scalar"
    assert classify_op(aten.nonzero.default, (dev,), {}).kind == "data_dependent"
    assert classify_op(aten.index.Tensor, (dev, [mask]), {}).kind == "data_dependent"
    assert classify_op(aten.index.Tensor, (dev, [torch.zeros(2, dtype=torch.long)]), {}) is None
    assert classify_op(aten.repeat_interleave.self_int, (dev, 2), {}) is None
    assert classify_op(aten.repeat_interleave.Tensor, (dev,), {}).kind == "data_dependent"
    assert classify_op(aten.repeat_interleave.Tensor, (dev,), {"output_size": 8}) is None
    assert classify_op(aten.mm.default, (dev, dev), {}) is None


def test_cuda_plan_reports_a_pageable_non_blocking_copy(fake_debug_mode):
    """What CUDA's debug mode never reports: under the default CUDA detector the dispatch check does."""
    rec = SyncRecorder()
    host = torch.ones(16)
    with SyncWatch(rec, device_type="cuda", detector="auto"):
        host.to("meta", non_blocking=True)  # AT-PAGEABLE
        host.to("meta")  # AT-BLOCKING (left to the debug mode, which does not warn here)
        host.sum().item()  # AT-HOST-ITEM (a host value: no sync on a GPU run)
    assert fake_debug_mode == ["warn", 0]
    assert _kinds(rec) == {_line("AT-PAGEABLE"): ("pageable_h2d", 1)}


def test_debug_mode_reports_are_labelled_with_the_op_at_their_line(fake_debug_mode):
    rec = SyncRecorder()
    host = torch.ones(16)
    with CudaSyncCatcher(rec), DispatchSyncDetector(rec, level="copies", emulate_host=True):
        host.sum().item(); debug_mode_warns()  # AT-ITEM
        host.to("meta"); debug_mode_warns()  # AT-H2D
        torch.nonzero(host); debug_mode_warns()  # AT-NONZERO
        debug_mode_warns()  # AT-UNKNOWN
        host.sum().item()  # AT-SILENT (the debug mode decides what syncs)
    assert _kinds(rec) == {
        _line("AT-ITEM"): ("scalar", 1), _line("AT-H2D"): ("h2d_copy", 1),
        _line("AT-NONZERO"): ("data_dependent", 1), _line("AT-UNKNOWN"): ("cuda_sync", 1),
    }


def test_full_dispatch_with_the_debug_mode_counts_a_sync_once(fake_debug_mode):
    rec = SyncRecorder()
    host = torch.ones(16)
    with CudaSyncCatcher(rec), DispatchSyncDetector(rec, level="full", emulate_host=True):
        for _ in range(3):
            host.sum().item(); debug_mode_warns()  # AT-TWICE
    assert _kinds(rec) == {_line("AT-TWICE"): ("scalar", 3)}


def test_other_warnings_still_show(fake_debug_mode):
    rec = SyncRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CudaSyncCatcher(rec):
            warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]
    assert rec.sites == {}


def test_call_catcher_wraps_restores_and_ignores_other_threads(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("device"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: calls.append("stream"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: calls.append("event"))
    stand_in = torch.cuda.synchronize
    rec = SyncRecorder()
    with SyncCallCatcher(rec):
        torch.cuda.synchronize()  # AT-DEVICE
        torch.cuda.Stream.synchronize(None)  # AT-STREAM
        torch.cuda.Event.synchronize(None)  # AT-EVENT
        torch.ones(3).tolist()  # AT-HOST-TOLIST (host tensor, GPU run: no sync)
        other = threading.Thread(target=torch.cuda.synchronize)
        other.start()
        other.join()
    assert calls == ["device", "stream", "event", "device"]
    assert _kinds(rec) == {_line("AT-DEVICE"): ("synchronize", 1), _line("AT-STREAM"): ("synchronize", 1),
                           _line("AT-EVENT"): ("synchronize", 1)}
    assert torch.cuda.synchronize is stand_in and "tolist" not in vars(torch.Tensor)


def test_sites_in_this_package_are_owned_by_it():
    """A sync inside lightning_perf's code is the package's, with the user's calling line beside it."""
    import lightning_perf

    package_file = os.path.join(os.path.dirname(lightning_perf.__file__), "callbacks", "_stand_in.py")
    scope: dict = {}
    exec(compile("def read(t):\n    return t.item()\n", package_file, "exec"), scope)
    rec = SyncRecorder()
    with DispatchSyncDetector(rec, emulate_host=True):
        scope["read"](torch.ones(()))  # AT-CALLER
    [site] = rec.sites.values()
    assert (site.owner, site.kind, site.location) == ("lightning_perf", "scalar", f"{package_file}:2")
    assert site.user_location == _line("AT-CALLER") and site.framework
    assert find_site().owner == "user"
