"""The throughput harnesses' headline is wall-clock tokens/s over the timed window, and every ratio
they report comes from it; the median step's figures stay beside it under ``*_median_step``.

``bench_gpt.py --smoke`` runs as a user would run it (in this process); the multi-GPU harnesses'
rank workers run on two CPU processes (gloo) and their rows are merged and compared as the
harnesses do it; the ratio helpers are checked against figures worked out by hand."""

import json
import os
from pathlib import Path

import bench_8gpu
import bench_gpt
import bench_parallel
import bench_parallel3d
import pytest
import torch
from _spawn import spawn

HEADLINE = ("tokens_per_s", "wall_s", "tokens", "steps_timed", "step_ms_mean", "step_ms_median", "step_ms_p90",
            "step_ms_max", "gc_in_window", "gc_count_in_window", "recompiles_in_window", "tokens_per_s_median_step")


def _assert_headline(row: dict, tokens: int, steps: int) -> None:
    assert set(HEADLINE) <= set(row), set(HEADLINE) - set(row)
    assert row["steps_timed"] == steps and row["tokens"] == tokens
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"], rel=1e-12)
    assert row["step_ms_mean"] * row["steps_timed"] == pytest.approx(1e3 * row["wall_s"], rel=1e-12)
    assert row["step_ms_median"] <= row["step_ms_p90"] <= row["step_ms_max"] <= 1e3 * row["wall_s"]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bench_gpt_smoke_headline_and_ratio_by_wall_clock(tmp_path, one_thread):
    bench_gpt.main(["--smoke", "--out", str(tmp_path), "--variants", "plain-compile,trainer-compile"])
    report = json.loads((tmp_path / "bench_gpt_smoke.json").read_text())
    plain, trainer = report["runs"]
    assert "error" not in plain and "error" not in trainer, (plain.get("traceback"), trainer.get("traceback"))
    for run in (plain, trainer):
        _assert_headline(run, tokens=3 * 4 * 64, steps=3)  # --smoke: 3 timed steps of 4 x 64 tokens
        assert run["tokens_per_s_median_step"] == pytest.approx(4 * 64 / (run["step_ms_median"] / 1e3))
    assert trainer["ratio_vs_plain"] == pytest.approx(trainer["tokens_per_s"] / plain["tokens_per_s"])
    assert trainer["ratio_vs_plain_median_step"] == pytest.approx(plain["step_ms_median"] / trainer["step_ms_median"])


SMOKE_3D = {"smoke": True, "preset": "gpt-1.3b", "seq_len": 32, "global_batch": 8, "warmup": 0, "steps": 2,
            "compile_backend": "aot_eager"}
SMOKE_ZERO = {"smoke": True, "preset": "gpt-1.3b", "seq_len": 32, "batch": 2, "warmup": 0, "steps": 2}


def _parallel3d_rank(rank: int, world: int, out_dir: Path) -> None:
    bench_parallel3d._worker(rank, world, int(os.environ["MASTER_PORT"]), ["dp2"], bench_parallel3d.GPT_VARIANTS,
                             SMOKE_3D, str(out_dir))


def _zero_rank(rank: int, world: int, out_dir: Path) -> None:
    bench_parallel._worker(rank, world, int(os.environ["MASTER_PORT"]), "zero2", bench_parallel.VARIANTS["zero2"],
                           dict(SMOKE_ZERO, profile_dir=str(out_dir)), str(out_dir / "result"))


def _merged(rank_fn, tmp_path: Path, pattern: str, merge, name: str) -> dict:
    """Two ranks of a harness's worker, their files merged as the harness does: rank 0's window."""
    spawn(rank_fn, 2, tmp_path, timeout=240)
    ranks = [json.loads((tmp_path / pattern.format(r)).read_text()) for r in range(2)]
    row = merge(name, ranks, None)
    assert row["ok"], row.get("traceback")
    assert row["rank"] == 0 and row["wall_s"] == ranks[0]["wall_s"]
    return row


@pytest.mark.slow
def test_bench_parallel3d_rank_window_is_rank0s_over_every_replicas_tokens(tmp_path):
    row = _merged(_parallel3d_rank, tmp_path, "dp2.rank{}.json", bench_parallel3d.merge_ranks, "dp2")
    _assert_headline(row, tokens=2 * 8 * 32, steps=2)  # the global batch, both replicas
    assert len(row["gc_count_in_window_per_rank"]) == len(row["recompiles_in_window_per_rank"]) == 2
    assert row["mfu"] / row["mfu_median_step"] == pytest.approx(row["tokens_per_s"] / row["tokens_per_s_median_step"])


@pytest.mark.slow
def test_bench_parallel_rank_window_is_rank0s_over_every_replicas_tokens(tmp_path):
    row = _merged(_zero_rank, tmp_path, "result.rank{}", bench_parallel.merge_ranks, "zero2")
    _assert_headline(row, tokens=2 * 2 * 2 * 32, steps=2)  # 2 steps x 2 ranks x 2 sequences x 32 tokens
    assert row["tokens_per_s_median_step"] == pytest.approx(2 * 2 * 32 / row["step_s_median"])
    assert len(row["gc_count_in_window_per_rank"]) == 2


def _row(variant: str, tokens_per_s: float, median: float, **extra) -> dict:
    return {"variant": variant, "ok": True, "tokens_per_s": tokens_per_s, "tokens_per_s_median_step": median,
            **extra}


def test_ratios_come_from_the_wall_clock_and_the_median_step_beside_them():
    runs = [_row("lightning_fsdp_full_shard", 100.0, 110.0), _row("zero3", 120.0, 121.0)]
    bench_parallel.add_ratios(runs)
    assert runs[1]["speedup_vs_lightning_fsdp_full_shard"] == pytest.approx(1.2)
    assert runs[1]["speedup_vs_lightning_fsdp_full_shard_median_step"] == pytest.approx(1.1)

    # 1000 tokens per step in both layouts: dp2 steps 1.0 s on average (median 0.8 s), pp2 1.25 s
    # (median 0.9 s); 1F1B over 2 stages and 4 microbatches leaves a 20% bubble in theory
    dp2 = _row("dp2", 1000.0 / 1.0, 1000.0 / 0.8, preset="gpt-1.3b")
    pp2 = _row("pp2_1f1b_m4", 1000.0 / 1.25, 1000.0 / 0.9, preset="gpt-1.3b", pp=2, microbatches=4,
               stages_per_rank=1)
    bench_parallel3d.add_bubble_figures([dp2, pp2])
    assert pp2["vs_dp2_tokens_per_s"] == pytest.approx(0.8)
    assert pp2["bubble_theory"] == pytest.approx(0.2)
    assert pp2["bubble_measured"] == pytest.approx(1 - 1.0 / 1.25)
    assert pp2["share_of_bubble_bound"] == pytest.approx(0.8 / (1 - 0.2))
    assert pp2["bubble_measured_median_step"] == pytest.approx(1 - 0.8 / 0.9)
    assert pp2["vs_dp2_tokens_per_s_median_step"] == pytest.approx(0.8 / 0.9)

    rows = [_row("gpt13b_dp1", 100.0, 110.0, world=1), _row("gpt13b_dp8_zero2", 760.0, 836.0, world=8),
            _row("gpt13b_dp8_lightning_fsdp", 700.0, 800.0, world=8)]
    bench_8gpu.add_figures(rows)
    scaling = bench_8gpu.weak_scaling(rows)
    assert scaling["8"]["efficiency"] == pytest.approx(0.95)
    assert scaling["8"]["efficiency_median_step"] == pytest.approx(0.95)
    assert rows[1]["vs_lightning_fsdp_dp8"] == pytest.approx(760 / 700)
    assert rows[1]["vs_lightning_fsdp_dp8_median_step"] == pytest.approx(836 / 800)
    assert rows[1]["tokens_per_s_per_gpu"] == pytest.approx(95.0)

    # the 4-GPU llama-8b layouts against ZeRO-3 dp4 of the same group
    four = [_row("llama8b_dp4_zero3_fp8", 400.0, 440.0, world=4), _row("llama8b_tp2_dp2_fp8", 300.0, 352.0, world=4)]
    for r in four:
        r["group"] = "llama8b_4gpu"
    bench_8gpu.add_figures(four)
    assert four[1]["vs_zero3_dp4"] == pytest.approx(0.75) and four[0]["vs_zero3_dp4"] == pytest.approx(1.0)
    assert four[1]["vs_zero3_dp4_median_step"] == pytest.approx(0.8)


def test_a_recipe_child_killed_after_its_window_keeps_the_window(tmp_path) -> None:
    import json

    from bench_recipes import child_result

    out = tmp_path / "_recipe-x.json"
    (tmp_path / "_recipe-x.json.window").write_text(json.dumps({"tokens_per_s": 5.0, "finished": False}))
    row = child_result(out, -9, "timed out after 280s", 300.0)
    assert row["tokens_per_s"] == 5.0 and row["warning"].startswith("rc=-9 after the window")
    assert not (tmp_path / "_recipe-x.json.window").exists()  # never read again by a later child
    assert child_result(out, -9, "timed out", 1.0) == {"error": "timed out", "process_s": 1.0}
    out.write_text(json.dumps({"tokens_per_s": 6.0}))
    assert child_result(out, 0, "", 2.0) == {"tokens_per_s": 6.0, "process_s": 2.0}


def test_global_batch_layouts_reach_the_same_tokens_per_step():
    """524,288 tokens of 2048 on two GPUs: ZeRO accumulates 16 micro-batches of 8 sequences per GPU, a 2-stage
    pipeline cuts one batch of 256 sequences into 64 microbatches of 4, tp2 accumulates 16 of 16."""
    variants, tokens = bench_parallel3d.GLOBAL_BATCH_VARIANTS, 2 * bench_parallel3d.GLOBAL_TOKENS_PER_GPU
    layout = lambda name, **kw: bench_parallel3d.global_batch_layout(variants[name], 2, tokens, 2048, **kw)  # noqa
    assert layout("gb_dp2_zero3_compile") == {"batch": 8, "accumulate": 16, "microbatches": None}
    assert layout("gb_pp2_1f1b_compile") == {"batch": 256, "accumulate": 1, "microbatches": 64}
    assert layout("gb_pp2_auto_compile") == {"batch": 256, "accumulate": 1, "microbatches": None}
    assert layout("gb_tp2_compile_batch") == {"batch": 16, "accumulate": 16, "microbatches": None}
    # the smoke run: micro-batches a quarter as large
    assert bench_parallel3d.global_batch_layout(variants["gb_dp2_zero3_compile"], 2, 512, 32, smoke=True) == \
        {"batch": 2, "accumulate": 4, "microbatches": None}
    with pytest.raises(ValueError, match="not a whole number of 2048-token sequences"):
        bench_parallel3d.global_batch_layout(variants["gb_dp2_zero3_compile"], 2, 1000, 2048)
    with pytest.raises(ValueError, match="no whole number of micro-batches of 8"):
        bench_parallel3d.global_batch_layout(variants["gb_dp2_zero3_compile"], 2, 12 * 2048, 2048)
    # four GPUs, llama-8b at T=8192: ZeRO-3 dp4 accumulates 16 x 2 sequences; pp2 x dp2 cuts 64 per replica
    four, big = bench_8gpu.global_batch_specs(), 4 * bench_parallel3d.GLOBAL_TOKENS_PER_GPU
    assert bench_parallel3d.global_batch_layout(four["gb_llama8b_dp4_zero3_fp8"], 4, big, 8192) == \
        {"batch": 2, "accumulate": 16, "microbatches": None}
    assert bench_parallel3d.global_batch_layout(four["gb_llama8b_pp2_dp2_fp8_1f1b"], 4, big, 8192) == \
        {"batch": 64, "accumulate": 1, "microbatches": 64}


def test_global_batch_rows_compare_with_zero3_at_their_batch_and_read_the_bubble_off_the_trace():
    # 524,288 tokens per step: ZeRO-3 takes 4.0 s, the pipeline 4.4 s; its slowest rank idles 3% and waits on
    # P2P 5% of the profiled step (the other rank less)
    common = {"preset": "gpt-1.3b", "global_batch": 256, "seq_len": 2048}
    zero3 = _row("gb_dp2_zero3_compile", 524288 / 4.0, 524288 / 3.9, **common)
    legacy = _row("dp2", 1000.0, 1000.0, preset="gpt-1.3b", global_batch=16, seq_len=2048)
    pp = _row("gb_pp2_1f1b_compile", 524288 / 4.4, 524288 / 4.3, pp=2, microbatches=64, stages_per_rank=1,
              step_breakdown_per_rank=[{"exposed_p2p_pct": 5.0, "idle_pct": 3.0},
                                       {"exposed_p2p_pct": 2.0, "idle_pct": 1.0}], **common)
    bench_parallel3d.add_bubble_figures([legacy, zero3, pp])
    assert pp["baseline"] == "gb_dp2_zero3_compile" and "vs_dp2_eager" not in pp  # dp2 ran another batch
    assert pp["vs_dp2_tokens_per_s"] == pytest.approx(4.0 / 4.4)
    assert pp["bubble_theory"] == pytest.approx(1 / 65)
    assert pp["bubble_measured"] == pytest.approx(1 - 4.0 / 4.4)
    assert pp["bubble_trace"] == pytest.approx(0.08)
