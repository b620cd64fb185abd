"""The flight recorder's variables (checked against the names in the installed torch), the dump of one
rank's buffer, and the command that reads a dump directory."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_perf.parallel.reliability.flight_recorder import (
    FLIGHT_RECORDER_VARS,
    default_dump_prefix,
    dump_files,
    dump_flight_recorder,
    dump_prefix,
    enable_flight_recorder,
    flight_recorder_env,
    read_command,
)

PREFIX = "/runs/a/flight_recorder/nccl_trace_rank_"


def test_every_unset_setting_is_set_under_all_its_names():
    assert flight_recorder_env(PREFIX, buffer_size=500, environ={}) == {
        "TORCH_FR_BUFFER_SIZE": "500", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": PREFIX, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": PREFIX,
    }


def test_a_setting_the_user_made_under_either_name_is_left_alone():
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/fr_"}
    assert flight_recorder_env(PREFIX, environ=user) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    env = dict(user)
    assert enable_flight_recorder(PREFIX, environ=env) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0" and dump_prefix(env) == "/mine/fr_"
    with pytest.raises(ValueError, match="buffer_size"):
        flight_recorder_env(PREFIX, buffer_size=0, environ={})


def test_names_are_the_ones_the_installed_torch_reads():
    headers = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    if not (headers / "FlightRecorder.hpp").exists():
        pytest.skip("this torch build ships no c10d headers")
    recorder = (headers / "FlightRecorder.hpp").read_text()
    nccl = (headers / "ProcessGroupNCCL.hpp").read_text()
    buffer = FLIGHT_RECORDER_VARS["buffer_size"]
    assert f'{{"{buffer[0]}", "{buffer[1]}"}}' in recorder  # the new name first, the old one its alias
    assert f'"{FLIGHT_RECORDER_VARS["dump_on_timeout"][0]}"' in nccl


def test_torchs_default_dump_prefix():
    assert default_dump_prefix({"XDG_CACHE_HOME": "/c"}) == "/c/torch/comm_lib_trace_rank_"
    assert default_dump_prefix({"HOME": "/h"}) == "/h/.cache/torch/comm_lib_trace_rank_"
    assert dump_prefix({"TORCH_FR_DUMP_TEMP_FILE": "/a/", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/b/"}) == "/a/"


def test_a_rank_dump_is_readable_as_the_message_says(tmp_path):
    c10d = torch._C._distributed_c10d
    if not hasattr(c10d, "_dump_fr_trace"):
        pytest.skip("this torch build's gloo does not record")
    prefix = str(tmp_path / "fr" / "nccl_trace_rank_")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))
        path = dump_flight_recorder(prefix, 0, nccl=False)
    finally:
        dist.destroy_process_group()
    assert path == prefix + "0" and dump_files(prefix) == [path]
    entries = pickle.load(open(path, "rb"))["entries"]
    assert [e["profiling_name"] for e in entries][-1] == "gloo:all_reduce" and entries[-1]["input_sizes"] == [[3]]
    # the analyser's own parser accepts the command line the message gives
    from torch.distributed.flight_recorder.components.config_manager import JobConfig

    command = read_command(prefix)
    args = command.split(" (")[0].split()[3:] + ["-j"]
    parsed = JobConfig().parse_args(args)
    assert (parsed.trace_dir, parsed.prefix) == (str(tmp_path / "fr"), "nccl_trace_rank_")
    assert f"pickle.load(open('{prefix}<rank>', 'rb'))['entries']" in command
    assert os.path.basename(path).startswith(parsed.prefix)


def test_the_collective_in_flight_of_a_recorder_that_marks_completion(monkeypatch):
    """NCCL's recorder marks completed collectives: the oldest one not completed is the one stuck."""
    from lightning_perf.parallel.reliability import flight_recorder as fr

    def entry(seq, name, state):
        return {"profiling_name": name, "collective_seq_id": seq, "state": state, "process_group": ("0", "default_pg")}

    entries = [entry(1, "nccl:all_reduce", "completed"), entry(2, "nccl:_reduce_scatter_base", "started"),
               entry(3, "nccl:_allgather_base", "scheduled")]
    monkeypatch.setattr(fr, "_dump_function", lambda nccl, **kw: lambda *a: pickle.dumps({"entries": entries}))
    assert fr.collective_in_flight(nccl=True) == (
        "nccl:_reduce_scatter_base #2 of process group 0 (default_pg), started (in flight, per this rank's "
        "flight recorder)")
    entries[1:] = [entry(2, "nccl:all_reduce", "completed")]
    assert fr.collective_in_flight(nccl=True) is None  # every one completed: nothing is stuck
    monkeypatch.setattr(fr, "_dump_function", lambda nccl, **kw: lambda *a: b"not a pickle")
    assert fr.collective_in_flight(nccl=True) is None  # never raises
    monkeypatch.setattr(fr, "_dump_function", lambda nccl, **kw: None)
    assert fr.collective_in_flight(nccl=False) is None  # a build without a recorder


def test_the_collective_in_flight_of_gloo_is_the_last_one_issued():
    from lightning_perf.parallel.reliability.flight_recorder import collective_in_flight

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(2), 0)
        found = collective_in_flight(nccl=False)
    finally:
        dist.destroy_process_group()
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):  # this build's gloo does not record
        assert found is None
    else:  # gloo marks no collective completed
        assert found is not None and found.startswith("gloo:broadcast #"), found
        assert found.endswith("(the last one issued, per this rank's flight recorder)"), found


def test_the_timeout_deadline_is_the_oldest_pending_collectives_creation_plus_its_groups_timeout(monkeypatch):
    """What NCCL's watchdog checks: a work item times out ``timeout`` after it was created."""
    from lightning_perf.parallel.reliability import flight_recorder as fr

    def entry(seq, state, created_s, timeout_ms=30_000):
        return {"profiling_name": "nccl:all_reduce", "collective_seq_id": seq, "state": state,
                "time_created_ns": int(created_s * 1e9), "timeout_ms": timeout_ms}

    entries = [entry(1, "completed", 100.0), entry(2, "scheduled", 105.5), entry(3, "scheduled", 106.0, 5_000)]
    assert fr.timeout_deadline(entries) == pytest.approx(135.5)  # #2's, though #3 would time out earlier alone
    assert fr.timeout_deadline(entries[:1]) is None  # nothing pending
    no_timeout = [dict(entries[1], timeout_ms=None)]
    assert fr.timeout_deadline(no_timeout) is None
    assert fr.timeout_deadline(no_timeout, default_timeout_s=60) == pytest.approx(165.5)
    assert fr.timeout_deadline([dict(entries[1], time_created_ns=None)]) is None
    # read from this process's NCCL recorder only (its active entries), never from gloo's
    asked = []

    def dump_function(nccl, *, nccl_only=False):
        asked.append((nccl, nccl_only))
        return lambda *args: asked.append(args) or pickle.dumps({"entries": entries[1:]})

    monkeypatch.setattr(fr, "_dump_function", dump_function)
    assert fr.collective_deadline() == pytest.approx(135.5)
    assert asked == [(True, True), (True, False, True)]  # collectives, no stack traces, only active ones
    monkeypatch.setattr(fr, "_dump_function", lambda nccl, **kw: None)  # a build without NCCL
    assert fr.collective_deadline() is None
    monkeypatch.setattr(fr, "_dump_function", lambda nccl, **kw: lambda *a: b"not a pickle")
    assert fr.collective_deadline() is None  # never raises
