"""Step-time breakdown, ranked recommendations, Markdown; stall maths and DataLoader advice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_perf.perf import PerfSummary, breakdown, dataloader_advice, exposed_wait, recommendations
from lightning_perf.perf import render_markdown


def test_breakdown_parts_sum_to_the_step():
    s = PerfSummary(step_time_s=1.0, data_wait_s=0.2, between_steps_s=0.3, exposed_comm_s=0.1)
    parts = breakdown(s)
    assert parts["exposed_comm"]["seconds"] == pytest.approx(0.1)
    assert parts["data_wait"]["seconds"] == pytest.approx(0.2)
    assert parts["host_overhead"]["seconds"] == pytest.approx(0.1)  # the gap beyond the data wait
    assert parts["compute"]["seconds"] == pytest.approx(0.6)
    assert sum(p["fraction"] for p in parts.values()) == pytest.approx(1.0)


def test_breakdown_never_exceeds_the_step():
    parts = breakdown(PerfSummary(step_time_s=1.0, data_wait_s=5.0, exposed_comm_s=0.5))
    assert parts["compute"]["seconds"] == 0 and parts["data_wait"]["seconds"] == pytest.approx(0.5)


def test_recommendations_rank_by_share():
    s = PerfSummary(step_time_s=1.0, data_wait_s=0.3, exposed_comm_s=0.15, mfu=0.1,
                    dataloader_advice=["try num_workers=8"], user_sync_sites=["train.py:12 in step(): .item()"])
    recs = recommendations(s)
    assert len(recs) == 3
    assert recs[0].startswith("Input pipeline: 30.0%") and "num_workers=8" in recs[0]
    assert recs[1].startswith("Communication: 15.0%")
    assert "train.py:12" in recs[2]
    md = render_markdown(s)
    assert "| data wait | 300.000 | 30.0% |" in md and "1. Input pipeline" in md


def test_exposed_communication_under_fsdp_units_of_one_block_recommends_larger_units():
    s = PerfSummary(step_time_s=1.0, exposed_comm_s=0.07, fsdp_blocks_per_unit=1)
    (tip,) = [r for r in recommendations(s, top=10) if r.startswith("Communication")]
    assert tip.startswith("Communication: 7.0%") and "blocks_per_unit=2" in tip and "GarbageCollection" in tip
    s.gc_scheduled = True  # already collecting on a schedule: only the units are suggested
    (tip,) = [r for r in recommendations(s, top=10) if r.startswith("Communication")]
    assert "blocks_per_unit=2" in tip and "GarbageCollection" not in tip
    # units already larger, or not a native ZeRO-2/3 run: only the general advice, above 10%
    for units in (2, None):
        s = PerfSummary(step_time_s=1.0, exposed_comm_s=0.07, fsdp_blocks_per_unit=units)
        assert not [r for r in recommendations(s, top=10) if r.startswith("Communication")]
        s.exposed_comm_s = 0.2
        (tip,) = [r for r in recommendations(s, top=10) if r.startswith("Communication")]
        assert "blocks_per_unit" not in tip
    # communication well hidden: nothing to say
    assert not recommendations(PerfSummary(step_time_s=1.0, exposed_comm_s=0.02, fsdp_blocks_per_unit=1))


def test_uneven_exposure_across_ranks_is_reported():
    s = PerfSummary(step_time_s=1.0, exposed_comm_s=0.04, exposed_comm_per_rank=[0.04, 0.31, None, 0.05])
    (tip,) = [r for r in recommendations(s, top=10) if r.startswith("Ranks wait")]
    assert "31.0% of the step on rank 1 but 4.0% on rank 0" in tip and "GarbageCollection" in tip
    assert "pauses on rank 0's host" in tip  # the rank the others wait for
    assert "| exposed comm per rank | 4.0% / 31.0% / n/a / 5.0% |" in render_markdown(s)
    even = PerfSummary(step_time_s=1.0, exposed_comm_per_rank=[0.04, 0.09])
    assert not [r for r in recommendations(even, top=10) if r.startswith("Ranks wait")]
    assert "exposed comm per rank" not in render_markdown(PerfSummary(step_time_s=1.0))


def test_exposed_wait():
    assert exposed_wait(0.2, None) == 0.2
    assert exposed_wait(0.2, 0.05) == 0.05  # the GPU was busy for the rest of the fetch
    assert exposed_wait(0.2, 0.5) == 0.2
    with pytest.raises(ValueError):
        exposed_wait(-0.1, None)


def test_report_states_its_window_units_and_an_unreliable_mfu():
    s = PerfSummary(step_time_s=0.5, steps=10, window="steps 2-11: mean over 10 measured steps after 2 warm-up; "
                    "wall time, data waits included", median_step_s=0.4, p90_step_s=0.9, tokens_per_sec=None,
                    samples_per_sec=16.0, tflops_per_device=0.002, device_unit="process",
                    mfu_note="ceiling unreliable: 0.002 TFLOP/s achieved per process is above the measured ceiling")
    md = render_markdown(s)
    assert "mean step time 500 ms (median 400, p90 900)" in md and "Window: steps 2-11: mean over 10" in md
    assert "tokens/s" not in md and "| samples/s (global) | 16 |" in md
    assert "| TFLOP/s per process | 0.002 |" in md and "per GPU" not in md
    assert "| MFU | n/a (ceiling unreliable: 0.002 TFLOP/s achieved" in md


def test_a_run_too_short_to_measure_says_so():
    s = PerfSummary(step_time_s=0.0, steps=0, window="no step measured: 2 step(s) ran and the first 2 are warm-up; "
                                                     "run at least 3 steps or lower warmup_steps",
                    exposed_comm_per_rank=[0.1, 0.2], gc_pause_s=0.0)
    md = render_markdown(s)
    assert "Too short to measure: no step measured: 2 step(s) ran" in md
    assert "| part |" not in md and "| MFU |" not in md and "| exposed comm per rank |" not in md


def test_dataloader_advice_reads_the_loader():
    tips = dataloader_advice(SimpleNamespace(num_workers=0, pin_memory=False), accelerator="cuda", cpu_count=16,
                             processes_per_node=2)
    assert any("num_workers=0" in t and "try num_workers=8" in t for t in tips)
    assert any("pin_memory=False" in t for t in tips)
    tips = dataloader_advice(SimpleNamespace(num_workers=8, pin_memory=True, prefetch_factor=2,
                                             persistent_workers=False), accelerator="cuda", cpu_count=16)
    assert any("prefetch_factor=2" in t for t in tips) and any("persistent_workers" in t for t in tips)
    tips = dataloader_advice(SimpleNamespace(num_workers=4, pin_memory=True, prefetch_factor=4,
                                             persistent_workers=True), accelerator="cuda", cpu_count=8)
    assert tips == [tips[0]] and "dataset itself is slow" in tips[0]
