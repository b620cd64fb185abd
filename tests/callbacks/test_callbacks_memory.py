"""MemoryMonitor on a CPU fit (hand-counted categories), its out-of-memory path (the CUDA dump mocked), and the
run settings PerfReport's advice reads."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.nn as nn

from callback_toys import D, H, T, V, ToyLM, loader, trainer
from lightning_perf.callbacks import MemoryMonitor, PerfReport
from lightning_perf.callbacks._settings import compiled_modules, run_settings_of

B = 4
N_PARAMS = V * D + D * H + H * V  # embedding, up, down (no biases)


class AdamToy(ToyLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def saved_bytes() -> int:
    """What ToyLM's forward saves for backward, by hand: token ids and targets (int64), the embedding output,
    up's output (gelu's input), gelu's output (down's input), log-softmax's output, and nll's scalar weight."""
    bt = B * T
    return 8 * bt + 4 * bt * D + 4 * bt * H + 4 * bt * H + 4 * bt * V + 8 * bt + 4


def test_categories_and_saved_activations_on_cpu(tmp_path):
    mon = MemoryMonitor(sample_step=1)
    t = trainer(tmp_path, [mon], max_steps=3)
    t.fit(AdamToy(), loader(batch_size=B))
    r = mon.report()
    assert r.device_type == "cpu" and r.peak_allocated is None and "need a CUDA device" in r.notes[0]
    assert r.parameters == 4 * N_PARAMS
    assert r.gradients == 4 * N_PARAMS
    assert r.optimizer_state == 2 * 4 * N_PARAMS + 3 * 4  # exp_avg, exp_avg_sq, a step per tensor
    assert r.activations == saved_bytes()
    assert r.selective_saves is None  # no repeated blocks to checkpoint
    assert r.micro_batch == B and mon.sampled_steps == [1]
    metrics = t.callback_metrics
    assert float(metrics["perf/mem_params_gb"]) == pytest.approx(4 * N_PARAMS / 1e9)
    assert float(metrics["perf/mem_saved_activations_gb"]) == pytest.approx(saved_bytes() / 1e9)
    assert "perf/mem_peak_allocated_gb" not in metrics  # needs the CUDA allocator


class OOMAt(AdamToy):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return super().training_step(batch, batch_idx)


SNAPSHOT = {
    "segments": [{"address": 0, "total_size": 3 << 30, "stream": 0, "segment_type": "large", "allocated_size": 0,
                  "active_size": 0, "blocks": [
                      {"size": 1 << 30, "requested_size": 1 << 30, "address": 0, "state": "active_allocated",
                       "frames": [{"filename": "??", "line": 0, "name": "empty_cuda"},
                                  {"filename": "/usr/lib/site-packages/torch/nn/modules/linear.py", "line": 125,
                                   "name": "forward"},
                                  {"filename": "/home/me/model.py", "line": 42, "name": "forward"}]},
                      {"size": 1 << 29, "requested_size": 1 << 29, "address": 1 << 30, "state": "inactive",
                       "frames": []}]}],
    "device_traces": [[{"action": "oom", "size": 2 << 30, "device_free": 1 << 20, "frames": []}]],
}


def test_out_of_memory_writes_the_snapshot_sites_and_says_where(tmp_path, monkeypatch, capsys):
    dumped = []

    def fake_dump(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        dumped.append(filename)
        with open(filename, "wb") as f:
            pickle.dump(SNAPSHOT, f)

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake_dump)
    mon = MemoryMonitor()
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer(tmp_path, [mon], max_steps=5).fit(OOMAt(), loader(batch_size=B))
    snap, md, js = (os.path.join(str(tmp_path), name) for name in
                    ("memory_snapshot_oom.pickle", "memory_sites_oom.md", "memory_sites_oom.json"))
    assert dumped == [snap] and mon.files == [snap, md, js]
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert f"Memory snapshot: {snap}" in notes and md in notes and "out of memory at step 2" in notes
    assert "no stack traces" in notes  # nothing was being recorded on this (CPU) run
    assert notes in capsys.readouterr().err
    text = open(md).read()
    assert "| 1.07 | 1 | /home/me/model.py:42 forward | torch/nn/modules/linear.py:125 forward |" in text  # 1 GiB
    assert "the failed allocation: 2.15 GB with 0.00105 GB free" in text
    data = json.load(open(js))
    assert data["total_bytes"] == 1 << 30  # the inactive block is cache, not a tensor
    assert data["memory"]["parameters"] == 4 * N_PARAMS and data["oom"] == {"size": 2 << 30, "device_free": 1 << 20}
    assert mon.report().files == mon.files


def test_out_of_memory_without_a_cuda_allocator_still_says_so(tmp_path):
    mon = MemoryMonitor(record_history=False)
    with pytest.raises(torch.OutOfMemoryError) as err:
        trainer(tmp_path, [mon], max_steps=5).fit(OOMAt(), loader(batch_size=B))
    assert "No CUDA memory snapshot could be taken" in "\n".join(err.value.__notes__)
    assert mon.files == [] and mon.report().parameters == 4 * N_PARAMS


def test_other_exceptions_pass_untouched(tmp_path):
    class Boom(AdamToy):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("not memory")

    mon = MemoryMonitor()
    with pytest.raises(RuntimeError) as err:
        trainer(tmp_path, [mon], max_steps=2).fit(Boom(), loader())
    assert not getattr(err.value, "__notes__", None) and mon.oom_message is None


def test_perf_report_includes_memory_and_settings(tmp_path):
    mon, report = MemoryMonitor(), PerfReport(warmup_steps=1, print_report=False)
    trainer(tmp_path, [mon, report], max_steps=4).fit(AdamToy(), loader(batch_size=B))
    md = open(report.files[0]).read()
    assert "Memory per cpu (step" not in md and "Memory per cpu:" in md
    assert f"| parameters | {4 * N_PARAMS / 1e9:.3g} |" in md
    data = json.load(open(report.files[1]))
    assert data["memory"]["optimizer_state"] == 2 * 4 * N_PARAMS + 12
    assert data["memory_advice"] and data["memory_advice"][0] in md
    s = data["settings"]
    assert (s["optimizer"], s["fused_optimizer"], s["precision"], s["compiled"]) == ("AdamW", False, "32-true", False)
    assert (s["num_workers"], s["pin_memory"], s["micro_batch"], s["zero_stage"]) == (0, False, 4, 0)


def test_settings_read_compile_and_checkpointing(tmp_path):
    import lightning as L

    from lightning_perf.models import GPTLightningModule
    from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing

    t = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  default_root_dir=str(tmp_path))
    gpt = GPTLightningModule("tiny", compile="default", compile_scope="block", activation_checkpointing="selective")
    s = run_settings_of(t, gpt)
    assert (s.gpt, s.compiled, s.compile_scope, s.compile_mode) == (True, True, "block", "default")
    assert (s.activation_checkpointing, s.kernels, s.fp8) == ("selective", "torch", "none")
    assert s.state("compile") and s.off("compile_model_scope") and s.state("activation_checkpointing")

    toy = ToyLM()
    assert run_settings_of(t, toy).compiled is False and run_settings_of(t, toy).activation_checkpointing == "none"
    toy.up.compile()  # nothing traced until called
    assert compiled_modules(toy) == ["up"]
    assert (run_settings_of(t, toy).compiled, run_settings_of(t, toy).compile_scope) == (True, "submodules")

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    w = Wrapper()
    w.net.compile()
    assert run_settings_of(t, w).compile_scope == "model"  # the one child that holds every parameter
    apply_activation_checkpointing(list(w.net), "full")
    assert run_settings_of(t, w).activation_checkpointing == "full"


def test_settings_are_what_the_strategy_and_the_module_state(tmp_path):
    """Any module or strategy may state its settings (perf_settings()); a foreign one is read by its attributes."""
    import lightning as L

    from lightning_perf.perf.run_settings import PerfSettings
    from lightning_perf.strategies import Parallel3DStrategy

    strategy = Parallel3DStrategy(zero_stage=3, activation_checkpointing="full", compile="default",
                                  fsdp_blocks_per_unit=2)
    t = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                  default_root_dir=str(tmp_path), precision="bf16-mixed")
    s = run_settings_of(t, ToyLM())  # a module that states nothing: the strategy's word, then the model's own
    # (one process: no data parallelism for FSDP2 to shard over)
    assert (s.precision, s.zero_stage, s.fsdp_blocks_per_unit, s.tensor_parallel_size) == ("bf16-mixed", 3, None, 1)
    assert (s.compiled, s.compile_scope, s.compile_mode) == (True, "block", "default")
    assert s.activation_checkpointing == "full"
    assert not s.gpt and s.kernels is None

    class Stating(ToyLM):  # a user's module that knows what it does
        def perf_settings(self) -> PerfSettings:
            return PerfSettings(compile_mode="max-autotune", compile_scope="model",
                                activation_checkpointing="selective")

    s = run_settings_of(t, Stating())
    assert (s.compile_scope, s.compile_mode, s.activation_checkpointing) == ("model", "max-autotune", "selective")

    class Unrelated(ToyLM):  # another meaning of the name: ignored, with a warning
        def perf_settings(self) -> dict:
            return {"compile": True}

    plain = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="ignore it"):
        s = run_settings_of(plain, Unrelated())
    assert (s.compiled, s.zero_stage, s.precision, s.activation_checkpointing) == (False, 0, "32-true", "none")


def test_arguments_are_checked():
    for kwargs in ({"sample_step": -1}, {"sample_step": True}, {"record_history": "sometimes"}, {"top": 0},
                   {"max_entries": 0}):
        with pytest.raises(ValueError):
            MemoryMonitor(**kwargs)


@pytest.mark.gpu
def test_cuda_peaks_and_snapshot(tmp_path):
    mon = MemoryMonitor(sample_step=1)
    t = trainer(tmp_path, [mon], max_steps=3, accelerator="gpu")
    t.fit(AdamToy(), loader(batch_size=B))
    r = mon.report()
    assert r.peak_allocated >= r.state + r.activations and r.peak_reserved >= r.peak_allocated
    assert os.path.exists(os.path.join(str(tmp_path), "memory_snapshot_step1.pickle"))
    assert json.load(open(os.path.join(str(tmp_path), "memory_sites_step1.json")))["sites"]
