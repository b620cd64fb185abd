"""Every callback of the pack together under the pack's own strategies, on 2 gloo ranks.

The callbacks are tested one by one elsewhere; this is what a user attaches to a sharded or
pipelined run: the fit must finish on every rank (no collective that only some ranks enter),
rank 0 must write the reports, and the figures must be the whole job's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _spawn import spawn

STEPS = 8
SEQ, BATCH = 32, 4  # per rank (per dp replica)


def _fit(strategy: Any, out: Path, rank: int) -> dict:
    import lightning as L

    from lightning_perf.callbacks import (
        CommOverlapMonitor,
        DataLoaderStallDetector,
        GarbageCollection,
        MFUMonitor,
        PerfReport,
        SyncPointWarner,
    )
    from lightning_perf.data import TokenDataModule
    from lightning_perf.models import GPTLightningModule

    L.seed_everything(0, verbose=False)
    module = GPTLightningModule("tiny-llama", warmup_steps=0, config_overrides={"tie_embeddings": False})
    mfu = MFUMonitor(peak_flops=1e11, warmup_steps=1, window=2)
    comm = CommOverlapMonitor(start_step=3, every_n_steps=0)
    collector = GarbageCollection(every_n_steps=2)
    report = PerfReport(warmup_steps=1, print_report=False)
    callbacks = [mfu, DataLoaderStallDetector(window=2, warmup_steps=1), SyncPointWarner(every_n_steps=0, start_step=2),
                 comm, collector, report]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out), num_sanity_val_steps=0,
                        limit_val_batches=0)
    data = TokenDataModule(source="synthetic", vocab_size=module.config.vocab_size, seq_len=SEQ, batch_size=BATCH)
    trainer.fit(module, datamodule=data)
    s = report.summary
    return {"steps": s.steps, "tokens_per_sec": s.tokens_per_sec, "step_time_s": s.step_time_s,
            "mfu_tokens_per_sec": mfu.summary().get("tokens_per_sec"),
            "per_rank": s.exposed_comm_per_rank, "gc_at": collector.collected_at, "gc_scheduled": s.gc_scheduled,
            "units": s.fsdp_blocks_per_unit, "files": [Path(f).name for f in report.files or []]}


def _zero3(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.strategies import ZeroStrategy

    return _fit(ZeroStrategy(stage=3, blocks_per_unit=2), out, rank)


def _pp2(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.strategies import Parallel3DStrategy

    return _fit(Parallel3DStrategy(pipeline_parallel_size=2, num_microbatches=2), out, rank)


def _check(results: list[dict], *, replicas: int, units) -> None:
    for r in results:
        # 8 steps, less 1 warm-up and the 2 steps other callbacks sampled
        assert r["steps"] == STEPS - 3
        assert r["gc_at"] == [2, 4, 6, 8] and r["gc_scheduled"]
        assert r["units"] == units
        assert len(r["per_rank"]) == 2 and all(x is not None and 0 <= x <= 1 for x in r["per_rank"])
        assert r["per_rank"] == results[0]["per_rank"]  # the same gathered list on every rank
        # tokens of the whole job: every data-parallel replica's batch, counted once
        # (a replica counted twice, or a pipeline rank counted as a replica, is off by 2x)
        expected = replicas * BATCH * SEQ / r["step_time_s"]
        assert r["tokens_per_sec"] == pytest.approx(expected, rel=1e-9)
        assert r["mfu_tokens_per_sec"] == pytest.approx(r["tokens_per_sec"], rel=1e-12)  # one window, one figure
    assert results[0]["files"] == ["perf_report.md", "perf_report.json"] and results[1]["files"] == []


@pytest.mark.slow
def test_all_callbacks_under_zero3(tmp_path) -> None:
    _check(spawn(_zero3, 2, tmp_path, timeout=240.0), replicas=2, units=2)
    assert (tmp_path / "perf_report.md").exists()


@pytest.mark.slow
def test_all_callbacks_under_a_pipeline(tmp_path) -> None:
    _check(spawn(_pp2, 2, tmp_path, timeout=240.0), replicas=1, units=None)
