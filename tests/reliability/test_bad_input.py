"""Bad input, tried systematically: random strategy / layout / model / data / precision combinations.

Every configuration drawn by hypothesis goes through what a real run does before the
process group exists (the GPT config, the data module, the precision plugin, the
strategy's constructor, ``_configure_launcher`` and ``setup_environment`` up to
``init_process_group``, which is replaced by a sentinel). It must either reach the
sentinel (accepted) or raise a ``ValueError`` from ``lightning_perf`` (or an
``ImportError`` naming a missing optional extra); anything else -- an error from inside
torch, a ``TypeError``, a hang -- fails the test with the configuration. A sample of the
accepted 2-rank configurations, of different kinds, then trains a step for real on 2 gloo
processes. The number of configurations tried is printed (``-s``) and recorded as a
junit property.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from _harness import launch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

N_EXAMPLES = 500
TRAIN_SAMPLE = 2
COUNTS: Counter = Counter()
REASONS: Counter = Counter()  # first words of each refusal
ACCEPTED: list[dict] = []


class ReachedProcessGroup(Exception):
    """Raised in place of creating the process group: every check before it passed."""


def _pick(rnd, valid: list, invalid: list = ()) -> Any:
    """A valid value, or (1 time in 24, when there are any) an impossible one."""
    if invalid and rnd.random() < 1 / 24:
        return rnd.choice(list(invalid))
    return rnd.choice(valid)


@st.composite
def configs(draw) -> dict:
    from lightning_perf.parallel.pipeline import SCHEDULES

    # a generator seeded by hypothesis: its choices follow the stated odds (hypothesis's own draws
    # favour boundary values, which would make nearly every configuration invalid)
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    p = lambda valid, invalid=(): _pick(rnd, valid, invalid)  # noqa: E731
    model = {
        "n_layer": p([2, 4, 4, 6, 3], [0, -1]),
        "n_head": p([2, 4], [0, 3]),
        "n_kv_head": p([None, None, None, 1, 2], [0, 3]),
        "n_embd": p([16, 32, 48], [0, 12]),
        "vocab_size": p([17, 64, 100, 260], [0]),
        "pad_vocab_multiple": p([1, 16, 64], [0]),
        "block_size": p([8, 16, 32], [0]),
        "tie_embeddings": p([True, False]),
        "positions": p(["learned", "rope"], ["sinusoid"]),
        "activation": p(["gelu", "swiglu"], ["relu2"]),
        "norm": p(["layernorm", "rmsnorm"]),
        "bias": False,
    }
    cfg = {
        "kind": p(["zero", "parallel3d"]),
        "world": p([1, 2, 3, 4, 8]),
        "model": model,
        "batch_size": p([1, 2, 3, 4, 6, 8], [0]),
        "seq_len": p([4, 8, 16], [0, 3, 40]),
        "precision": p(["32-true", "bf16-mixed", "16-mixed", "bf16-true"], ["64-true", "fp8"]),
    }
    if cfg["kind"] == "zero":
        cfg["strategy"] = {
            "stage": p([1, 2, 3], [0, 4]),
            "backend": p([None, None, "native", "deepspeed"]),
            "offload_optimizer": p([False, False, False, True]),
            "offload_params": p([False, False, False, True]),
            "gradient_compression": p([None, None, None, "fp16", "bf16", "powersgd"], ["int8"]),
            "prefetch": p([0, 1, 2], [-1]),
            "reshard_after_forward": p([None, None, True, False]),
            "init": p(["rank0", "meta"], ["lazy"]),
        }
    else:
        cfg["strategy"] = {
            "data_parallel_size": p(["auto", 1, 2, 4], [0]),
            "tensor_parallel_size": p([1, 2, 4], [0]),
            "pipeline_parallel_size": p([1, 2, 4], [0]),
            "zero_stage": p([0, 1, 2, 3], [4]),
            "pipeline_schedule": p(list(SCHEDULES), ["dualpipe"]),
            "num_microbatches": p([None, 1, 2, 3, 4, 8], [0]),
            "stages_per_rank": p([1, 2, 3]),
            "sequence_parallel": p([True, False]),
            "activation_checkpointing": p(["none", "full", "selective"], ["some"]),
        }
        s = cfg["strategy"]
        if rnd.random() < 0.75:  # usually a stage count the schedule runs
            fixed = SCHEDULES.get(s["pipeline_schedule"], (None, None, 1))[2]
            s["stages_per_rank"] = fixed or (2 if s["pipeline_parallel_size"] > 1 else 1)
        if rnd.random() < 0.75:  # usually a world size that fits the layout
            dp = s["data_parallel_size"] if s["data_parallel_size"] != "auto" else rnd.choice([1, 2])
            cfg["world"] = max(1, dp * s["tensor_parallel_size"] * s["pipeline_parallel_size"])
    return cfg


def build(cfg: dict, *, real: bool = False) -> tuple[Any, Any, Any]:
    """(strategy, module, data module) of ``cfg``; raises what the user would see."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_perf.data import TokenDataModule
    from lightning_perf.models.gpt import GPTConfig
    from lightning_perf.models.gpt.module import GPTLightningModule
    from lightning_perf.plugins import PerfPrecision
    from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

    model_config = GPTConfig(name="h", **cfg["model"])
    data = TokenDataModule(source="synthetic", vocab_size=model_config.vocab_size, seq_len=cfg["seq_len"],
                           batch_size=cfg["batch_size"], synthetic_train_samples=64, synthetic_val_samples=8)
    precision = PerfPrecision(cfg["precision"])
    cls = ZeroStrategy if cfg["kind"] == "zero" else Parallel3DStrategy
    extra: dict[str, Any] = {"precision_plugin": precision}
    if not real:
        extra.update(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * cfg["world"],
                     cluster_environment=LightningEnvironment())
    else:
        from datetime import timedelta

        extra["timeout"] = timedelta(seconds=60)
    strategy = cls(**cfg["strategy"], **extra)
    module = GPTLightningModule(model_config, warmup_steps=0)
    return strategy, module, data


def check_before_process_group(cfg: dict) -> str:
    strategy, module, data = build(cfg)
    strategy.connect(module)
    module._trainer = SimpleNamespace(datamodule=data)  # what the Trainer attaches before setup_environment
    strategy._configure_launcher()

    def sentinel(*args: Any, **kwargs: Any) -> None:
        raise ReachedProcessGroup

    with mock.patch("lightning_perf.strategies.base._init_dist_connection", sentinel):
        strategy.setup_environment()
    raise AssertionError("setup_environment returned without creating a process group")


def _raised_by_us(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "lightning_perf" in frames[-1].filename


@settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cfg=configs())
def test_every_config_is_accepted_or_refused_clearly(cfg: dict) -> None:
    import warnings

    COUNTS["tried"] += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the pipeline bubble warning
            check_before_process_group(cfg)
    except ReachedProcessGroup:
        COUNTS["accepted"] += 1
        if cfg["world"] == 2:
            ACCEPTED.append(cfg)
    except ValueError as e:
        assert str(e) and _raised_by_us(e), (cfg, traceback.format_exc())
        COUNTS["ValueError"] += 1
        REASONS[str(e)[:40]] += 1
    except ImportError as e:  # an optional extra that is not installed, named in the message
        assert "pip install" in str(e) or "deepspeed" in str(e).lower(), (cfg, traceback.format_exc())
        COUNTS["ImportError (missing extra)"] += 1


def test_report_how_many_were_tried(record_property) -> None:
    if not COUNTS:
        test_every_config_is_accepted_or_refused_clearly()
    print(f"\nbad-input property test: {dict(COUNTS)}; most common refusals: {REASONS.most_common(12)}")
    record_property("configs_tried", COUNTS["tried"])
    assert COUNTS["tried"] >= N_EXAMPLES // 2
    assert COUNTS["accepted"] > 0 and COUNTS["ValueError"] > 0


def _train_sample(rank: int, world: int, out: Path, cfgs: list[dict]) -> list[Any]:
    import lightning as L

    results = []
    for cfg in cfgs:
        L.seed_everything(0, verbose=False)
        strategy, module, data = build(cfg, real=True)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)
        try:
            trainer.fit(module, data)
            results.append(float(trainer.callback_metrics["train/loss"]))
        except Exception as e:
            results.append(f"{type(e).__name__}: {e}")
            raise
    return results


def _sample(accepted: list[dict]) -> list[dict]:
    """One accepted layout of each strategy (fp32 or bf16-mixed, no DeepSpeed), 3D pipelines first."""
    chosen: dict[str, dict] = {}
    for cfg in sorted(accepted, key=lambda c: c["strategy"].get("pipeline_parallel_size", 0) < 2):
        s = cfg["strategy"]
        deepspeed = s.get("backend") == "deepspeed" or s.get("offload_optimizer") or s.get("offload_params")
        # DeepSpeed (a JIT-built op) and the half precisions train in tests/strategies; here: layouts
        if cfg["kind"] not in chosen and cfg["precision"] in ("32-true", "bf16-mixed") and not deepspeed:
            chosen[cfg["kind"]] = cfg
    return list(chosen.values())[:TRAIN_SAMPLE]


def test_a_sample_of_accepted_configs_trains(tmp_path) -> None:
    if not ACCEPTED:
        test_every_config_is_accepted_or_refused_clearly()
    sample = _sample(ACCEPTED)
    assert len(sample) >= 2, ACCEPTED[:5]
    print("\ntraining a step of:", [(c["kind"], c["strategy"], c["batch_size"], c["seq_len"]) for c in sample])
    run = launch(_train_sample, 2, tmp_path, sample, timeout=120)
    assert all(c == 0 for c in run.exitcodes), (sample, run.errors)
    for losses in run.results:
        assert len(losses) == len(sample) and all(torch.isfinite(torch.tensor(losses))), losses
