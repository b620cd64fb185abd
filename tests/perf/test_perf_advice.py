"""Advice that knows the run: settings + measured breakdown -> ranked changes; nothing on is ever advised."""

from __future__ import annotations

import itertools

import pytest

from lightning_perf.perf import PerfSummary, breakdown, recommendations
from lightning_perf.perf.advice import advise
from lightning_perf.perf.memory import MemoryReport, memory_advice
from lightning_perf.perf.run_settings import CHANGES, RunSettings

GPT_124M, GPT_1_3B = 124_475_904, 1_315_819_520


def _roofline(**shares):
    """Roofline groups as (bound, time share) by name."""
    return [{"name": name, "bound": bound, "time_share": share} for name, (bound, share) in shares.items()]


TUNED_GPT = RunSettings(device_type="cuda", precision="bf16-mixed", compiled=True, compile_scope="block",
                        compile_mode="default", gpt=True, kernels="torch", fp8="none", fp8_capable=True,
                        activation_checkpointing="none", num_workers=4, pin_memory=True, zero_stage=0,
                        optimizer="AdamW", fused_optimizer=True, n_params=GPT_124M, gc_scheduled=False)
EAGER_FP32 = RunSettings(device_type="cuda", precision="32-true", compiled=False, gpt=False,
                         activation_checkpointing="none", num_workers=0, pin_memory=False, zero_stage=0,
                         optimizer="AdamW", fused_optimizer=False, n_params=50_000_000, gc_scheduled=False)
ZERO3_1B = RunSettings(device_type="cuda", precision="bf16-mixed", compiled=True, compile_scope="block",
                       compile_mode="default", gpt=True, kernels="triton", fp8="none", fp8_capable=True,
                       activation_checkpointing="none", zero_stage=3, data_parallel_size=2, fsdp_blocks_per_unit=1,
                       optimizer="AdamW", fused_optimizer=True, n_params=GPT_1_3B, gc_scheduled=False)
LOADER_TIPS = ["num_workers=0 loads batches in the training process; try num_workers=8 (16 CPUs / 1 processes)",
               "pin_memory=False: host-to-device copies come from pageable memory and block the host; "
               "set pin_memory=True"]

# (settings, summary fields, memory, expected (text prefix, share of the step saved or None) in rank order)
CASES = {
    "tuned bf16 + fused AdamW + per-block compile at 124M": (
        TUNED_GPT,
        dict(mfu=0.2, roofline=_roofline(matmul=("compute", 0.5), elementwise=("memory", 0.3), norm=("overhead", 0.2))),
        None,
        [("FP8 linears: compute-bound matmuls take 50% of kernel time", 0.5 * 0.5 * 1.0),
         ("Memory-bound elementwise/norm/copy ops take 30% of kernel time; the pack's fused", 0.5 * 0.3 * 1.0),
         ("Compile scope: the blocks are compiled one by one and overhead-bound ops take 20%", 0.5 * 0.2 * 1.0)]),
    "eager fp32 with a data stall": (
        EAGER_FP32,
        dict(data_wait_s=0.3, between_steps_s=0.3, dataloader_advice=LOADER_TIPS,
             roofline=_roofline(matmul=("compute", 0.5), elementwise=("overhead", 0.3))),
        None,
        [("Input pipeline: 30.0% of each step waits for data; num_workers=0", 0.3),
         ("Precision: 32-true runs matmuls at the fp32 / TF32 rate", 0.5 * 0.5 * 0.7),  # matmul share x compute
         ("Overhead-bound ops take 30% of kernel time (launch latency); torch.compile", 0.5 * 0.3 * 0.7),
         ("Optimizer: AdamW runs unfused; AdamW(..., fused=True)", None)]),
    "ZeRO-3 at 1.3B, one block per unit, automatic GC": (
        ZERO3_1B,
        dict(exposed_comm_s=0.08, gc_pause_s=0.02, gc_max_pause_s=0.05, gc_collections=3,
             roofline=_roofline(matmul=("compute", 0.7))),
        None,
        [("FP8 linears: compute-bound matmuls take 70% of kernel time; config_overrides={'fp8': 'tensorwise', "
          "'fused_qkv': True}", 0.5 * 0.7 * 0.92),
         ("Communication: 8.0% of each step is exposed; shard two blocks per FSDP2 unit", 0.08),
         ("Python garbage collection paused the host 20 ms per step", 0.02)]),
    "full checkpointing with a quarter of the GPU in use": (
        RunSettings(device_type="cuda", precision="bf16-mixed", compiled=True, compile_scope="model",
                    compile_mode="default", activation_checkpointing="full", zero_stage=0, optimizer="SGD",
                    fused_optimizer=None),
        dict(mfu=0.2, hfu=0.25),
        MemoryReport(device_type="cuda", device_total=int(80e9), peak_allocated=int(20e9)),
        [("Activation checkpointing 'full' recomputes the whole forward (~20% of the step's compute) with the peak "
          "20 of 80 GB", 1 - 0.2 / 0.25),
         ("MFU is 20.0% with the peak 20 of 80 GB: raise the micro-batch.", None)]),
    "nothing known: only what is measured": (
        RunSettings(),
        dict(mfu=0.1, roofline=_roofline(elementwise=("memory", 0.5)), exposed_comm_s=0.2),
        None,
        [("Communication: 20.0% of each step is exposed; overlap it", 0.2)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ranked_advice(name):
    settings, fields, memory, expected = CASES[name]
    s = PerfSummary(step_time_s=1.0, settings=settings, memory=memory, **fields)
    got = advise(s, breakdown(s), settings, memory)
    assert [a.text[:len(text)] for a, (text, _) in zip(got, expected)] == [text for text, _ in expected]
    assert len(got) == len(expected), [a.text for a in got]
    for a, (_, share) in zip(got, expected):
        assert a.fraction == (None if share is None else pytest.approx(share, rel=1e-3)), a.text
    assert recommendations(s, top=2) == [a.text for a in got[:2]]


def test_per_block_compile_is_sized_by_the_runs_launch_overhead():
    over = dict(roofline=_roofline(matmul=("compute", 0.1), norm=("overhead", 0.3)))
    s = PerfSummary(step_time_s=0.04, settings=TUNED_GPT, **over)
    (tip,) = [a for a in advise(s, breakdown(s), TUNED_GPT) if a.changes == ("compile_model_scope",)]
    assert "overhead-bound ops take 30% of kernel time" in tip.text and "compile_scope='model'" in tip.text
    assert tip.seconds(0.04) == pytest.approx(0.04 * 0.5 * 0.3)
    assert "benchmarks" not in tip.text
    # nothing measured to size it: no advice; nor where per-block compile composes with per-block sharding
    plain = PerfSummary(step_time_s=0.04, settings=TUNED_GPT, roofline=_roofline(matmul=("compute", 0.9)))
    assert not [a for a in advise(plain, breakdown(plain), TUNED_GPT) if a.changes == ("compile_model_scope",)]
    zero3 = RunSettings(**{**TUNED_GPT.__dict__, "zero_stage": 3, "data_parallel_size": 2})
    assert not [a for a in advise(s, breakdown(s), zero3) if a.changes == ("compile_model_scope",)]


def test_fp8_and_recompute_advice_come_from_the_runs_measurements():
    # FP8 halves at most the compute-bound matmuls' time; memory-bound matmuls give no FP8 advice
    s = PerfSummary(step_time_s=1.0, data_wait_s=0.2, roofline=_roofline(matmul=("compute", 0.6)))
    (fp8,) = [a for a in advise(s, breakdown(s), TUNED_GPT) if a.changes == ("fp8",)]
    assert fp8.fraction == pytest.approx(0.5 * 0.6 * 0.8)
    slow = PerfSummary(step_time_s=1.0, roofline=_roofline(matmul=("memory", 0.6)))
    assert not [a for a in advise(slow, breakdown(slow), TUNED_GPT) if a.changes == ("fp8",)]
    # full checkpointing: the recomputed share is HFU against MFU; without HFU, a forward's share of a step
    full = RunSettings(**{**TUNED_GPT.__dict__, "activation_checkpointing": "full"})
    memory = MemoryReport(device_type="cuda", device_total=int(80e9), peak_allocated=int(20e9))
    for hfu, share in ((0.3, 1 - 0.2 / 0.3), (None, 0.25)):
        run = PerfSummary(step_time_s=1.0, mfu=0.2, hfu=hfu)
        (tip,) = [a for a in advise(run, breakdown(run), full, memory) if a.text.startswith("Activation")]
        assert tip.fraction == pytest.approx(share) and f"~{100 * share:.0f}% of the step's compute" in tip.text


def test_the_old_blanket_tip_is_gone_when_everything_is_on():
    s = PerfSummary(step_time_s=1.0, mfu=0.1, roofline=_roofline(elementwise=("overhead", 0.5)))
    on = RunSettings(**{**TUNED_GPT.__dict__, "compile_scope": "model", "compile_mode": "reduce-overhead"})
    texts = " ".join(recommendations(PerfSummary(**{**s.__dict__, "settings": on}), top=10))
    assert "bf16" not in texts and "fused" not in texts and "torch.compile" not in texts and "CUDA graphs" not in texts


# every switch the advice knows, with the values that turn it on and off
SWITCHES = {
    "precision": ("32-true", "bf16-mixed"),
    "compile": ((False, None, None), (True, "block", "default"), (True, "model", "default"),
                (True, "model", "reduce-overhead")),
    "fused_optimizer": (False, True),
    "kernels": ("torch", "triton"),
    "fp8": ("none", "tensorwise"),
    "activation_checkpointing": ("none", "full", "selective"),
    "num_workers": (0, 4),
    "pin_memory": (False, True),
    "gc_scheduled": (False, True),
    "zero": ((0, None), (3, 1), (3, 2)),
}
# what a tip would say to switch each on: must never appear once it is on
PHRASES = {
    "bf16": ("bf16",), "compile": ("torch.compile",), "compile_model_scope": ("compile_scope='model'",),
    "cuda_graphs": ("CUDA graphs", "reduce-overhead"), "fused_optimizer": ("fused=True", "fused AdamW"),
    "triton_kernels": ("'kernels': 'triton'",), "fp8": ("'fp8'",),
    "activation_checkpointing": ("activation checkpointing (",), "dataloader_workers": ("num_workers=0",),
    "pin_memory": ("set pin_memory=True",), "gc_schedule": ("GarbageCollection",),
    "fsdp_larger_units": ("blocks_per_unit=2", "fewer FSDP units"), "zero1": ("ZeRO-1",), "zero2": ("ZeRO-2",),
    "zero3": ("ZeRO-3",), "expandable_segments": ("expandable_segments",),
}


def _settings(values: dict) -> RunSettings:
    compiled, scope, mode = values["compile"]
    stage, units = values["zero"]
    return RunSettings(device_type="cuda", fp8_capable=True, gpt=True, n_params=GPT_1_3B // 2, micro_batch=8,
                       precision=values["precision"], compiled=compiled, compile_scope=scope, compile_mode=mode,
                       optimizer="AdamW", fused_optimizer=values["fused_optimizer"], kernels=values["kernels"],
                       fp8=values["fp8"], activation_checkpointing=values["activation_checkpointing"],
                       num_workers=values["num_workers"], pin_memory=values["pin_memory"],
                       gc_scheduled=values["gc_scheduled"], zero_stage=stage, fsdp_blocks_per_unit=units,
                       data_parallel_size=8, expandable_segments=False)


def test_nothing_already_on_is_ever_advised():
    """Every combination of the switches, against a run that triggers every rule."""
    memory = MemoryReport(device_type="cuda", device_total=int(80e9), parameters=int(2e9), gradients=int(4e9),
                          optimizer_state=int(8e9), activations=int(12e9), peak_allocated=int(30e9),
                          peak_reserved=int(40e9), inactive_split=int(2e9), micro_batch=8,
                          selective_saves=int(5e9), full_saves=int(10e9))
    fields = dict(step_time_s=1.0, data_wait_s=0.1, between_steps_s=0.16, exposed_comm_s=0.12, mfu=0.1,
                  exposed_comm_per_rank=[0.02, 0.3], user_sync_sites=["train.py:3 in step(): .item()"],
                  gc_pause_s=0.03, gc_max_pause_s=0.05, gc_collections=4, dataloader_advice=LOADER_TIPS[::-1],
                  roofline=_roofline(matmul=("compute", 0.4), elementwise=("memory", 0.3), norm=("overhead", 0.3)))
    suggested: set[str] = set()
    names = list(SWITCHES)
    for combo in itertools.product(*SWITCHES.values()):
        s = _settings(dict(zip(names, combo)))
        summary = PerfSummary(**fields, gc_scheduled=bool(s.gc_scheduled), settings=s, memory=memory)
        tips = [(a.text, a.changes) for a in advise(summary, breakdown(summary), s, memory)]
        tips += [(m.text, m.changes) for m in memory_advice(memory, s)]
        on = [c for c in CHANGES if s.state(c)]
        for text, changes in tips:
            assert not set(changes) & set(on), (combo, text, changes)
            assert not [p for c in on for p in PHRASES[c] if p in text], (combo, text)
            suggested.update(changes)
    # and every switch was suggested in some combination where it was off
    assert suggested == set(CHANGES)
