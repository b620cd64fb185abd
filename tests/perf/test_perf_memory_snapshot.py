"""Allocation sites of a synthetic snapshot in the format of ``torch.cuda.memory._snapshot()``."""

from __future__ import annotations

from lightning_perf.perf.memory_snapshot import (
    NO_STACK,
    block_allocations,
    is_library_frame,
    oom_event,
    site_of,
    sites_markdown,
    top_sites,
    trace_peak_allocations,
)

SP = "/usr/lib/python3.11/site-packages"
LINEAR = {"filename": f"{SP}/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
CALL = {"filename": f"{SP}/torch/nn/modules/module.py", "line": 1775, "name": "_call_impl"}
ADAMW = {"filename": f"{SP}/torch/optim/adamw.py", "line": 171, "name": "_init_group"}
CPP = {"filename": "??", "line": 0, "name": "at::native::empty_cuda"}
MLP = {"filename": "/home/me/model.py", "line": 42, "name": "forward"}
ATTN = {"filename": "/home/me/model.py", "line": 30, "name": "forward"}
LOOP = {"filename": f"{SP}/lightning/pytorch/core/optimizer.py", "line": 154, "name": "step"}
TRAIN = {"filename": "/home/me/train.py", "line": 7, "name": "<module>"}


def block(size, frames, state="active_allocated"):
    return {"size": size, "requested_size": size, "address": 0, "state": state, "frames": frames}


SNAPSHOT = {
    "segments": [
        {"address": 0, "total_size": 2 << 30, "stream": 0, "segment_type": "large", "allocated_size": 0,
         "active_size": 0, "blocks": [
             block(600 << 20, [CPP, LINEAR, CALL, MLP, CALL, TRAIN]),  # innermost frame first
             block(400 << 20, [CPP, LINEAR, CALL, MLP, CALL, TRAIN]),
             block(300 << 20, [CPP, ATTN, CALL, TRAIN]),
             block(500 << 20, [CPP, LINEAR, CALL, MLP], state="inactive"),  # cached, no tensor: not counted
             block(200 << 20, [CPP, ADAMW, LOOP, TRAIN]),
         ]},
        {"address": 1 << 40, "total_size": 1 << 30, "stream": 0, "segment_type": "large", "allocated_size": 0,
         "active_size": 0, "blocks": [
             block(100 << 20, []),  # allocated while history was off
             block(50 << 20, [CPP, CALL]),  # torch frames only
             {"size": 25 << 20, "state": "active_allocated",  # the older format: frames under "history"
              "history": [{"addr": 0, "real_size": 25 << 20, "frames": [ATTN]}]},
         ]},
    ],
    "device_traces": [[]],
}


def test_frames_of_torch_are_library_frames():
    assert is_library_frame(LINEAR["filename"]) and is_library_frame("??") and is_library_frame("<eval_with_key>.3")
    assert is_library_frame("/tmp/torchinductor_me/ab/cabc.py")
    assert not is_library_frame(MLP["filename"]) and not is_library_frame(LOOP["filename"])
    assert site_of([CPP, LINEAR, CALL, MLP, TRAIN]) == ("/home/me/model.py:42 forward",
                                                        "torch/nn/modules/linear.py:125 forward")
    assert site_of([CPP, ADAMW, LOOP]) == ("lightning/pytorch/core/optimizer.py:154 step",
                                           "torch/optim/adamw.py:171 _init_group")
    assert site_of([]) == (NO_STACK, None)
    assert site_of([CPP]) == ("(torch frames only)", None)


def test_blocks_aggregate_by_innermost_non_torch_frame():
    allocations = block_allocations(SNAPSHOT)
    assert sum(size for size, _ in allocations) == (600 + 400 + 300 + 200 + 100 + 50 + 25) << 20  # inactive left out
    sites = top_sites(allocations, top=10)
    assert [(s.site, s.bytes >> 20, s.allocations) for s in sites] == [
        ("/home/me/model.py:42 forward", 1000, 2),
        ("/home/me/model.py:30 forward", 300, 1),
        ("lightning/pytorch/core/optimizer.py:154 step", 200, 1),
        (NO_STACK, 100, 1),
        ("(torch frames only)", 50, 1),
        ("/home/me/model.py:30 forward", 25, 1),  # same line, no torch frame beneath: its own row
    ]
    assert sites[0].via == "torch/nn/modules/linear.py:125 forward" and sites[-1].via is None
    assert [s.site for s in top_sites(allocations, top=2)] == ["/home/me/model.py:42 forward",
                                                               "/home/me/model.py:30 forward"]
    md = sites_markdown(sites[:1], title="At the OOM", total=sum(s for s, _ in allocations))
    assert "## At the OOM" in md and "| 1.05 | 2 | /home/me/model.py:42 forward |" in md  # 1000 MiB = 1.05 GB


def test_trace_replay_finds_the_allocations_live_at_the_peak():
    def alloc(addr, mb, frames):
        return {"action": "alloc", "addr": addr, "size": mb << 20, "stream": 0, "frames": frames}

    def free(addr, mb):
        return {"action": "free_completed", "addr": addr, "size": mb << 20, "stream": 0, "frames": []}

    trace = [
        alloc(1, 150, [CPP, LINEAR, MLP]),         # 150
        alloc(2, 300, [CPP, ATTN]),                # 450
        free(99, 1000),                            # freed memory from before the recording: ignored
        alloc(3, 200, [CPP, LINEAR, MLP]),         # 650: the peak
        {"action": "free_requested", "addr": 2, "size": 300 << 20, "stream": 0, "frames": []},
        free(2, 300),                              # 350
        alloc(4, 250, [CPP, ADAMW, LOOP]),         # 600
        {"action": "segment_alloc", "addr": 5, "size": 2 << 30, "stream": 0, "frames": []},
    ]
    peak, live = trace_peak_allocations({"segments": [], "device_traces": [trace]})
    assert peak == 650 << 20
    sites = top_sites(live)
    assert [(s.site, s.bytes >> 20) for s in sites] == [("/home/me/model.py:42 forward", 350),
                                                        ("/home/me/model.py:30 forward", 300)]
    assert trace_peak_allocations({"segments": [], "device_traces": []}) == (0, [])
    assert trace_peak_allocations({"device_traces": [trace]}, device=3) == (0, [])


def test_oom_event_is_the_last_failed_request():
    snap = {"device_traces": [[{"action": "oom", "size": 1 << 30, "device_free": 5 << 20, "frames": []},
                               {"action": "alloc", "addr": 1, "size": 8, "frames": []},
                               {"action": "oom", "size": 2 << 30, "device_free": 3 << 20, "frames": []}]]}
    assert oom_event(snap) == {"size": 2 << 30, "device_free": 3 << 20}
    assert oom_event(SNAPSHOT) is None
