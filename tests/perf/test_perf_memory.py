"""Memory by category (hand-counted bytes), allocator statistics, and advice sized by hand arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_perf.perf.memory import (
    GB,
    AllocatorStats,
    MemoryReport,
    count_categories,
    memory_advice,
    memory_markdown,
    tensor_bytes,
)
from lightning_perf.perf.run_settings import RunSettings


def test_categories_of_a_tiny_model_with_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert count_categories(model.parameters(), [opt]).total == (16 * 32 + 32 + 32 * 8) * 4  # before any step
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    cats = count_categories(model.parameters(), [opt])
    n = 16 * 32 + 32 + 32 * 8  # 800 fp32 parameters in 3 tensors
    assert cats.parameters == 4 * n
    assert cats.gradients == 4 * n
    assert cats.optimizer_state == 2 * 4 * n + 3 * 4  # exp_avg, exp_avg_sq, and a 4-byte step per tensor
    assert cats.total == 4 * n * 4 + 12


def test_each_storage_counts_once():
    shared = nn.Linear(8, 8, bias=False)
    tied = nn.ModuleDict({"a": shared, "b": shared})  # one weight under two names
    assert count_categories(tied.parameters()).parameters == 8 * 8 * 4
    flat = torch.zeros(100)  # gradients as views of one bucket (DDP's gradient_as_bucket_view)
    views = [flat[:30].view(5, 6), flat[30:100]]
    assert tensor_bytes(views) == 100 * 4
    half = torch.zeros(10, dtype=torch.bfloat16)
    assert tensor_bytes([half, half[2:], None, "not a tensor"]) == 20
    assert tensor_bytes([torch.zeros(4)], device=torch.device("cuda")) == 0  # only the device asked for


@pytest.fixture
def fake_world_of_4():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def test_sharded_tensors_count_this_ranks_shard(fake_world_of_4):
    from torch.distributed.tensor import DTensor, Shard

    def shard() -> DTensor:  # a (32, 16) tensor split over 4 ranks: this rank holds (8, 16)
        return DTensor.from_local(torch.zeros(8, 16), fake_world_of_4, [Shard(0)], run_check=False)

    w = nn.Parameter(shard())
    assert w.shape == (32, 16)
    w.grad = shard()
    opt = torch.optim.AdamW([w])
    opt.state[w] = {"step": torch.tensor(1.0), "exp_avg": shard(), "exp_avg_sq": shard()}
    cats = count_categories([w], [opt])
    assert (cats.parameters, cats.gradients, cats.optimizer_state) == (8 * 16 * 4, 8 * 16 * 4, 2 * 8 * 16 * 4 + 4)


def test_allocator_stats_and_report_figures():
    stats = AllocatorStats.from_stats({
        "allocated_bytes.all.current": 10, "reserved_bytes.all.current": 20, "allocated_bytes.all.peak": 74,
        "reserved_bytes.all.peak": 84, "inactive_split_bytes.all.current": 1, "inactive_split_bytes.all.peak": 3})
    assert (stats.allocated, stats.reserved, stats.peak_allocated, stats.peak_reserved) == (10, 20, 74, 84)
    assert (stats.inactive_split, stats.peak_inactive_split) == (1, 3)
    assert AllocatorStats.from_stats({}) == AllocatorStats()
    nested = {"allocated_bytes": {"all": {"current": 10, "peak": 74}, "large_pool": {"peak": 70}},
              "reserved_bytes": {"all": {"current": 20, "peak": 84}}, "inactive_split_bytes": {"all": {"peak": 3}}}
    assert AllocatorStats.from_stats(nested) == AllocatorStats(allocated=10, reserved=20, peak_allocated=74,
                                                               peak_reserved=84, peak_inactive_split=3)
    r = MemoryReport(device_type="cuda", parameters=6, gradients=12, optimizer_state=24, activations=20,
                     peak_allocated=74, peak_reserved=84)
    assert (r.state, r.fragmentation, r.other) == (42, 10, 12)  # other = 74 - 42 - 20
    assert MemoryReport(device_type="cuda", parameters=6, gradients=12, optimizer_state=24, activations=40,
                        peak_allocated=74).other == 0  # never negative
    assert r.reference() == (74, "peak")
    cpu = MemoryReport(device_type="cpu", parameters=6, gradients=None, optimizer_state=24, activations=10)
    assert cpu.state is None and cpu.fragmentation is None and cpu.other is None
    assert cpu.reference() == (40, "counted")
    assert cpu.as_dict()["parameters_gb"] == 6 / GB


def _big_run(**overrides) -> MemoryReport:
    """A 74 GB peak on an 80 GB GPU: activations 45 GB, AdamW state 16 GB, fp32 grads 8 GB, weights 4 GB, 1 GB else."""
    figures = dict(device_type="cuda", device_total=int(80e9), parameters=int(4e9), gradients=int(8e9),
                   optimizer_state=int(16e9), activations=int(45e9), peak_allocated=int(74e9),
                   peak_reserved=int(84e9), inactive_split=int(3e9), micro_batch=16,
                   selective_saves=int(20e9), full_saves=int(38e9))
    figures.update(overrides)
    return MemoryReport(**figures)


def test_memory_advice_sized_by_hand():
    s = RunSettings(device_type="cuda", gpt=True, activation_checkpointing="none", zero_stage=0,
                    data_parallel_size=8, expandable_segments=False)
    tips = memory_advice(_big_run(), s)
    assert [t.saves_bytes for t in tips] == [int(22.5e9), int(20e9), int(14e9), int(10e9)]
    micro, ac, zero, frag = (t.text for t in tips)
    # 45 / 74 = 60.8%: "61% of the 74 GB peak"; 16 -> 8 halves 45 GB
    assert micro == ("activations are 61% of the 74 GB peak: micro-batch 16 -> 8 halves activations (~22.5 GB); "
                     "accumulate_grad_batches=2 keeps the global batch.")
    # ZeRO-1: 16 * 7/8 = 14; ZeRO-2: (16 + 8) * 7/8 = 21; ZeRO-3: (16 + 8 + 4) * 7/8 = 24.5
    assert zero.startswith("optimizer state 16 GB per GPU: ZeRO-1 (strategy='zero1') over 8 GPUs saves ~14 GB; ")
    assert "ZeRO-2 (strategy='zero2', the gradients too) over 8 GPUs saves ~21 GB" in zero
    assert "ZeRO-3 (strategy='zero3', the parameters too) over 8 GPUs saves ~24.5 GB" in zero
    assert ac.startswith("activations are 61% of the 74 GB peak: activation checkpointing "
                         "(GPTLightningModule(activation_checkpointing=...): mode 'selective' saves ~20 GB")
    assert "'full' ~38 GB" in ac
    # 84 - 74 = 10 GB cached, 10 / 84 = 11.9% of the reserved peak
    assert frag.startswith("10 GB (12% of the 84 GB reserved) is cached but not allocated at the peak, 3 GB of it in")
    assert "expandable_segments:True" in frag


def test_memory_advice_never_suggests_what_is_on():
    on = RunSettings(device_type="cuda", activation_checkpointing="selective", zero_stage=1, data_parallel_size=8,
                     expandable_segments=True)
    tips = memory_advice(_big_run(), on)
    texts = " ".join(t.text for t in tips)
    assert "activation checkpointing" not in texts and "ZeRO-1" not in texts and "expandable" not in texts
    (zero,) = [t for t in tips if t.text.startswith("optimizer state")]
    assert zero.saves_bytes == int(21e9) and zero.changes == ("zero2", "zero3")
    # unknown settings suggest no switch at all; one GPU has nothing to shard over
    assert [t.changes for t in memory_advice(_big_run(), RunSettings())] == [()]
    one = RunSettings(zero_stage=0, data_parallel_size=1, activation_checkpointing="none")
    assert not [t for t in memory_advice(_big_run(), one) if "ZeRO" in t.text]
    # activations below a quarter of the peak: neither checkpointing nor a smaller micro-batch
    assert not memory_advice(_big_run(activations=int(15e9)), RunSettings(activation_checkpointing="none"))


def test_memory_advice_without_a_measured_split_and_on_cpu():
    s = RunSettings(activation_checkpointing="none")
    (micro, ac) = memory_advice(_big_run(selective_saves=None, full_saves=None, micro_batch=3), s)  # unsized last
    assert "'selective' recomputes norms and elementwise ops" in ac.text and ac.saves_bytes is None
    assert "micro-batch 3 -> 1 cuts activations by 67% (~30 GB)" in micro.text  # 45 * (1 - 1/3)
    cpu = MemoryReport(device_type="cpu", parameters=int(1e9), gradients=int(1e9), optimizer_state=int(2e9),
                       activations=int(4e9), micro_batch=8)
    (micro,) = memory_advice(cpu, RunSettings())
    assert micro.text.startswith("activations are 50% of the 8 GB counted: micro-batch 8 -> 4 halves")
    md = memory_markdown(cpu)
    assert "Memory per cpu:" in md and "| activations | 4 | 50% |" in md and "share of counted" in md


def test_memory_markdown_rows_and_files():
    r = _big_run(files=["/logs/memory_snapshot_step1.pickle"], peak_step=3)
    md = memory_markdown(r, RunSettings(activation_checkpointing="none"))
    assert "Memory per GPU (step 3):" in md
    assert "| optimizer state | 16 | 22% |" in md  # 16 / 74
    assert "| activations | 45 | 61% |" in md
    assert "| other (temporaries, batch, workspaces) | 1 | 1% |" in md  # 74 - 4 - 8 - 16 - 45
    assert "| reserved - allocated at peak | 10 | 14% |" in md
    assert "Memory advice:" in md and "- /logs/memory_snapshot_step1.pickle" in md
