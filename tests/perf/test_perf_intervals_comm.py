"""Interval maths on synthetic sets, bus-bandwidth formulas and trace analysis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_perf.perf import analyze_comm_trace, bus_bandwidth, expected_link, intersect, overlap_stats, total, union
from lightning_perf.perf.comm import collective_kind


def test_union_merges_overlapping_and_touching():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    with pytest.raises(ValueError, match="before its start"):
        union([(2, 1)])


def test_disjoint_comm_is_fully_exposed():
    s = overlap_stats(comm=[(0, 1), (4, 5)], compute=[(1, 4)])
    assert (s.comm, s.overlapped, s.exposed, s.window) == (2, 0, 2, 5)
    assert s.exposed_fraction == pytest.approx(0.4)


def test_nested_comm_is_fully_hidden():
    s = overlap_stats(comm=[(2, 3), (3.5, 4)], compute=[(0, 10)])
    assert s.exposed == 0 and s.overlapped == pytest.approx(1.5) and s.overlap_fraction == 1.0


def test_partial_overlap():
    # comm 0-4 and 6-8; compute 2-7 -> overlapped 2-4 and 6-7 = 3; exposed 6 - 3 = 3
    s = overlap_stats(comm=[(0, 4), (6, 8)], compute=[(2, 5), (4.5, 7)], window=10)
    assert s.comm == 6 and s.overlapped == pytest.approx(3) and s.exposed == pytest.approx(3)
    assert s.exposed_fraction == pytest.approx(0.3)
    assert intersect([(0, 4), (6, 8)], [(2, 7)]) == [(2, 4), (6, 7)]


def test_no_comm():
    s = overlap_stats(comm=[], compute=[(0, 1)])
    assert s.exposed == 0 and s.exposed_fraction == 0 and s.overlap_fraction == 0


intervals = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)).map(lambda t: (t[0], t[0] + t[1])), max_size=8)


@settings(max_examples=60, deadline=None)
@given(intervals, intervals)
def test_overlap_matches_a_brute_force_count(comm, compute):
    """On integer grids, lengths equal the number of covered unit cells."""
    def cells(ivs):
        return {x for s, e in ivs for x in range(s, e)}

    c, k = cells(comm), cells(compute)
    s = overlap_stats(comm, compute, window=50)
    assert total(comm) == len(c)
    assert s.overlapped == len(c & k)
    assert s.exposed == len(c - k)


@pytest.mark.parametrize("kind, factor", [("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8), ("reduce_scatter", 7 / 8),
                                          ("all_to_all", 7 / 8), ("broadcast", 1.0), ("send_recv", 1.0)])
def test_bus_bandwidth_factors(kind, factor):
    algbw, busbw = bus_bandwidth(kind, 8e9, 0.1, 8)
    assert algbw == pytest.approx(8e10)
    assert busbw == pytest.approx(8e10 * factor)


def test_bus_bandwidth_errors_and_links():
    with pytest.raises(ValueError, match="unknown collective"):
        bus_bandwidth("gossip", 1, 1, 2)
    assert expected_link("H100 SXM")[0] == "nvlink4"
    assert expected_link("H100 SXM", multi_node=True)[0] == "infiniband-ndr"
    assert expected_link(None)[0] == "pcie4"


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
    ("gloo:all_reduce", "all_reduce"), ("gloo:broadcast", "broadcast"), ("ncclDevKernel_SendRecv", "send_recv"),
])
def test_collective_kinds(name, kind):
    assert collective_kind(name) == kind


def test_gpu_trace_analysis():
    """Two NCCL all-reduces of 100 MB over 4 ranks, the first hidden under a GEMM, the second exposed."""
    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    meta = {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "dur": 1,
            "args": {"Collective name": "allreduce", "In msg nelems": 50_000_000, "Out msg nelems": 50_000_000,
                     "dtype": "BFloat16", "Group size": 4}}
    events = [
        k("sm90_xmma_gemm_bf16", 0, 1000),
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 200, 500),
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 1000, 500),
        dict(meta, ts=100), dict(meta, ts=900),
    ]
    a = analyze_comm_trace(events, ranks=4)
    assert a.overlap.comm == pytest.approx(1e-3)
    assert a.overlap.exposed == pytest.approx(0.5e-3)
    assert a.overlap.exposed_fraction == pytest.approx(0.5e-3 / 1.5e-3)
    ar = a.collectives["all_reduce"]
    assert ar.count == 2 and ar.bytes == 2 * 100e6
    assert ar.algbw == pytest.approx(200e6 / 1e-3)
    assert ar.busbw == pytest.approx(ar.algbw * 2 * 3 / 4)


def test_step_breakdown_splits_a_pipeline_step() -> None:
    """A 1000 us step of one pipeline rank: compute 0-300 and 500-800 us; a send/recv waiting 250-500 us
    (50 us under compute, 200 us alone); an all-gather 780-900 us (20 us under compute, 120 us alone) and a
    broadcast 880-920 us (its 20 us beside the all-gather counted once); nothing runs 920-1000 us."""
    from lightning_perf.perf import step_breakdown

    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [k("nvjet_sm90_gemm", 0, 300), k("nvjet_sm90_gemm", 500, 300), k("ncclDevKernel_SendRecv", 250, 250),
              k("ncclDevKernel_AllGather_RING_LL", 780, 120), k("ncclDevKernel_Broadcast_RING_LL", 880, 40),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 2000}]  # host ops: not GPU time
    b = step_breakdown(events, step_s=1000e-6)
    assert b.compute == pytest.approx(600e-6)
    assert b.exposed_p2p == pytest.approx(200e-6)
    assert b.exposed_collectives == pytest.approx(120e-6)
    assert b.idle == pytest.approx(80e-6)
    assert sum(b.shares().values()) == pytest.approx(1.0)
    assert b.as_dict()["exposed_p2p_pct"] == pytest.approx(20.0)
    # without a step length: the span of the kernels (0-920 us), so no idle time
    assert step_breakdown(events).step == pytest.approx(920e-6) and step_breakdown(events).idle == 0.0
    # a P2P wait under an all-gather counts as P2P, once
    both = [k("ncclDevKernel_SendRecv", 0, 100), k("ncclDevKernel_AllGather_RING_LL", 50, 100)]
    b = step_breakdown(both, step_s=200e-6)
    assert (b.exposed_p2p, b.exposed_collectives, b.idle) == pytest.approx((100e-6, 50e-6, 50e-6))


def test_step_breakdown_of_a_gloo_trace() -> None:
    """On CPU the gloo threads' annotations are the communication, the main thread's aten ops the compute."""
    from lightning_perf.perf import step_breakdown

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [op("aten::mm", 0, 100), op("aten::add", 100, 100), op("aten::mm", 400, 100),
              op("gloo:send", 150, 150, tid=7), op("gloo:all_gather", 300, 50, tid=8), op("aten::mm", 0, 1, tid=9)]
    b = step_breakdown(events, step_s=600e-6)
    assert (b.compute, b.exposed_p2p, b.exposed_collectives, b.idle) == pytest.approx((300e-6, 100e-6, 50e-6, 150e-6))


def test_gpu_time_breakdown_by_kernel_name() -> None:
    """Hopper kernel names as a profiled gpt-1.3b step reports them, two steps of a known timeline."""
    from lightning_perf.perf.gpu_time import gpu_time_breakdown, gpu_time_category

    names = {
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)": "attention",
        "_bwd_dkdv_tma_kernel": "attention",
        "triton_per_fused__to_copy_add_native_layer_norm_backward_view_11": "inductor",
        "triton_tem_fused_mm_3": "matmul",
        "_norm_bwd_kernel": "pack_elementwise",
        "_gelu_fwd_kernel": "pack_elementwise",
        "_ce_rows_kernel": "pack_loss",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "communication",
        "Memset (Device)": "copy_cast",
        "some_custom_kernel": "other",
    }
    for name, category in names.items():
        assert gpu_time_category(name) == category, name
    # per step: 0-100 us matmul, 100-120 us inductor, a 30 us gap, 150-200 us attention, with NCCL
    # 170-230 us overlapping the attention and running 30 us alone; the second step 1000 us later
    events = []
    for step in range(2):
        t0 = 1000.0 * step
        for name, ts, dur in (("nvjet_sm90_tst_x", 0, 100), ("triton_poi_fused_gelu_1", 100, 20),
                              ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 150, 50),
                              ("ncclDevKernel_AllGather_RING_LL", 170, 60)):
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t0 + ts, "dur": dur})
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000})  # not GPU time
    out = gpu_time_breakdown(events, steps=2)
    assert out["ms_per_step"] == pytest.approx(
        {"matmul": 0.1, "communication": 0.06, "attention": 0.05, "inductor": 0.02})
    assert out["window_ms_per_step"] == pytest.approx(1.23 / 2)  # first start to last end, over 2 steps
    assert out["busy_ms_per_step"] == pytest.approx(0.2)
    assert out["idle_ms_per_step"] == pytest.approx(1.23 / 2 - 0.2)
    assert list(out["top_kernels_ms_per_step"])[0] == "nvjet_sm90_tst_x"
    assert out["top_kernels_launches_per_step"]["nvjet_sm90_tst_x"] == 1
    from lightning_perf.perf.gpu_time import kernel_label

    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
            "(at::native::ADAM_MODE)1, false>, float*, double>(at::native::(anonymous namespace)::"
            "TensorListMetadata<4>, float*, double)")
    assert kernel_label(adam) == ("multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4, "
                                  "(ADAM_MODE)1, false>, float*, double>")
    assert kernel_label("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "ncclDevKernel_AllGather_RING_LL"
    assert gpu_time_breakdown([], steps=1) == {}
