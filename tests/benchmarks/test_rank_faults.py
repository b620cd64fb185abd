"""``diagnose_faults.py --parts rank_faults`` says truthfully what ended each rank: the pack's watchdog, the pack's
error, NCCL's abort; whether the pack's lines end the log; and, for a rank that ends before the fault is planted,
what ended it and where the other rank was. The logs are shaped as the NCCL runs' logs are (abridged)."""

import json
import time
from types import SimpleNamespace

import _rank_faults as rf

NCCL_ABORT_LOG = [
    "rank 0: rank 1 stopped responding at step 5 (no heartbeat for 5.0 s): collectives with it will fail or time out",
    "[rank0]:[E1128 00:07:46.679 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=149, OpType=_ALLGATHER_BASE, Timeout(ms)=60000) ran for 60086 milliseconds before timing out.",
    "[rank0]:[E1128 00:08:46.681 ProcessGroupNCCL.cpp:2119] [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group "
    "watchdog thread terminated with exception: [Rank 0] Watchdog caught collective operation timeout",
    "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:692 (most recent "
    "call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f42 in libc10.so)",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
]
PACK_EXIT_LOG = [
    "rank 0: rank 1 stopped responding at step 5 (no heartbeat for 5.0 s): collectives with it will fail or time out",
    "rank 0: rank 1 stopped responding at step 5 (no heartbeat for 24.1 s): it died or is frozen; this rank is at "
    "step 5; this rank waits in nccl:_all_gather_base #149 of process group 0 (default_pg)",
    "rank 0: exiting with code 1 so the job ends instead of hanging; restart it (fit(ckpt_path=\"last\") resumes "
    "from the last complete checkpoint)",
    "flight recorder: each rank's last collectives are dumped to run/flight_recorder/nccl_trace_rank_<rank>",
    "[rank0]:[W1128 00:07:20.1 ProcessGroupNCCL.cpp:1826] Failed to check the \"should dump\" flag on TCPStore",
]


def test_what_ended_a_survivor() -> None:
    assert rf.how_ended(-6, NCCL_ABORT_LOG, {}) == "SIGABRT from NCCL's watchdog (collective timeout)"
    assert not rf.pack_words_last(NCCL_ABORT_LOG)  # the C++ abort came after the pack's line
    assert rf.how_ended(1, PACK_EXIT_LOG, {}) == "the pack's watchdog (exit 1)"
    assert rf.pack_words_last(PACK_EXIT_LOG)  # a warning of NCCL's after them does not count
    assert not rf.pack_words_last(PACK_EXIT_LOG + NCCL_ABORT_LOG[1:2])
    raised = {"outcome": "raised", "type": "RankFailureError"}
    assert rf.how_ended(1, ["RankFailureError: rank 0: a collective failed"], raised) == \
        "the pack's error (RankFailureError)"
    assert rf.how_ended(1, [], {"outcome": "raised", "type": "ValueError"}) == "an error (ValueError)"
    assert rf.how_ended(-9, [], {}) == "signal SIGKILL" and rf.how_ended(0, [], {}) == "finished"
    assert rf.how_ended(None, [], {}) == "still running"
    assert [rf.short_ending(rf.how_ended(c, log, {}), False) for c, log in ((-6, NCCL_ABORT_LOG), (1, PACK_EXIT_LOG))] \
        == ["abort", "pack exit"]
    assert rf.short_ending("the pack's watchdog (exit 1)", True) == "hung"


def test_a_rank_ending_before_the_fault_is_reported_with_where_the_other_was(tmp_path) -> None:
    """The NCCL run's frozen-rank scenario: rank 0 aborted by NCCL while rank 1 still waited for the save."""
    spec = dict(rf.settings(False), **rf.SCENARIOS["sigstop_rank1"], expected_step=4)
    sc = rf.Scenario("sigstop_rank1", spec, tmp_path)
    sc.procs = [SimpleNamespace(returncode=-6), SimpleNamespace(returncode=None)]
    sc.exit_times = {0: time.time()}
    (tmp_path / "rank0.log").write_text("\n".join(NCCL_ABORT_LOG) + "\n")
    (tmp_path / "rank1.stage.json").write_text(json.dumps(
        {"stage": "waiting for the checkpoint in flight to be final", "time": time.time() - 120, "step": 5}))
    said = sc._where_ranks_were()
    assert said.startswith("rank 0 ended (SIGABRT from NCCL's watchdog (collective timeout)) while rank 1 was "
                           "waiting for the checkpoint in flight to be final (since 12"), said
    (tmp_path / "ready.json").write_text(json.dumps({"time": time.time(), "step": 5}))
    assert sc._where_ranks_were().endswith("rank 1 was at the start of the fault's step, ready to be stopped")
