"""Bad input, tried systematically: random strategy / layout / model / data / precision configurations.

Every configuration goes through what a real run does before the process group exists (the GPT
config, the data module, the precision plugin, the strategy's constructor, ``_configure_launcher``
and ``setup_environment`` up to ``init_process_group``, which is replaced by a sentinel). Both
directions are asserted:

- valid by construction -> accepted: a configuration drawn from the valid space (every value
  valid, the combination consistent: a world size the layout fills, whole heads and rows on each
  tensor-parallel rank, blocks that fill the pipeline stages, a batch the microbatches divide, ...)
  must reach the sentinel;
- one planted invalid value -> refused: the same kind of configuration with exactly one value made
  impossible must raise a ``ValueError`` from ``lightning_perf`` that names it, before the sentinel;
- anything mixed -> accepted or refused clearly: values drawn independently, each invalid one time in
  24, must reach the sentinel or raise a ``ValueError`` from ``lightning_perf`` (or an ``ImportError``
  naming a missing extra); anything else -- an error from inside torch, a ``TypeError``, a hang -- fails;
- valid configurations train: a valid ZeRO configuration and a valid 3D one (a pipeline or tensor
  parallelism) on 2 ranks, drawn afresh, each train a step on 2 gloo processes with a finite loss.

Each run draws a new seed, printed (``-s``) and recorded as a junit property; every failure message
names it, and ``LIGHTNING_PERF_FUZZ_SEED=<seed>`` replays that run's configurations exactly.
"""

from __future__ import annotations

import copy
import os
import random
import traceback
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional
from unittest import mock

import pytest
import torch
from _harness import launch

SEED_ENV = "LIGHTNING_PERF_FUZZ_SEED"
SEED = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else random.SystemRandom().randrange(2**32)
REPLAY = f"(replay: {SEED_ENV}={SEED})"
N_VALID = 50
N_PLANTED = 80
N_MIXED = 150


class ReachedProcessGroup(Exception):
    """Raised in place of creating the process group: every check before it passed."""


@pytest.fixture(autouse=True)
def _seed(record_property):
    print(f"\nconfig fuzz seed {SEED} {REPLAY}")
    record_property("fuzz_seed", SEED)


def _rng(name: str) -> random.Random:
    """One generator per test, from the run's seed: a test replays alone as in the whole file."""
    return random.Random(f"{SEED}:{name}")


# ---- the valid space -----------------------------------------------------------------------------

SCHEDULES_ANY_STAGES = ("interleaved_1f1b", "looped_bfs", "zero_bubble")


def _model(rnd: random.Random, tp: int = 1, stages: int = 1) -> dict:
    n_head = tp * rnd.choice([1, 2]) if tp > 1 else rnd.choice([1, 2, 4])
    kv_choices = [k for k in range(1, n_head + 1) if n_head % k == 0 and k % tp == 0]
    n_kv_head = rnd.choice(kv_choices)
    return {
        "n_layer": stages * rnd.choice([1, 2]),
        "n_head": n_head,
        "n_kv_head": n_kv_head if rnd.random() < 0.5 else (None if n_kv_head == n_head else n_kv_head),
        "n_embd": n_head * rnd.choice([8, 16]),  # even head dim: RoPE takes it
        "vocab_size": rnd.choice([17, 64, 100, 260]),
        "pad_vocab_multiple": rnd.choice([16, 64]) if tp > 1 else rnd.choice([1, 16, 64]),
        "block_size": rnd.choice([16, 32]),
        "tie_embeddings": rnd.choice([True, False]),
        "positions": rnd.choice(["learned", "rope"]),
        "activation": rnd.choice(["gelu", "swiglu"]),
        "norm": rnd.choice(["layernorm", "rmsnorm"]),
        "bias": False,
    }


def valid_config(rnd: random.Random, *, kind: Optional[str] = None, world: Optional[int] = None) -> dict:
    """A configuration every check must accept (``world``: force that many ranks)."""
    from lightning_perf.parallel.layout.config_3d import SPLIT_BACKWARD_SCHEDULES
    from lightning_perf.parallel.model_parallel.pipeline import SCHEDULES, zbv_runs_on_gloo

    kind = kind or rnd.choice(["zero", "parallel3d"])
    cfg: dict[str, Any] = {
        "kind": kind,
        "precision": rnd.choice(["32-true", "bf16-mixed", "16-mixed", "bf16-true"]),
        "seq_len": rnd.choice([4, 8, 16]),
    }
    if kind == "zero":
        stage = rnd.choice([1, 2, 3])
        offload = stage > 1 and rnd.random() < 0.2
        cfg["strategy"] = {
            "stage": stage,
            "backend": rnd.choice([None, "native"]),
            "offload_optimizer": offload,
            "offload_params": offload and stage == 3 and rnd.random() < 0.5,
            # bf16 is NCCL's alone: refused on the CPU, below
            "gradient_compression": rnd.choice([None, "fp16", "powersgd"]) if stage == 1 else None,
            "prefetch": rnd.choice([0, 1, 2]),
            "reshard_after_forward": rnd.choice([None, False] + ([True] if stage == 3 else [])),
            "init": rnd.choice(["rank0", "meta"]),
        }
        cfg["world"] = world or rnd.choice([1, 2, 3, 4, 8])
        cfg["model"] = _model(rnd)
        cfg["batch_size"] = rnd.choice([1, 2, 3, 4, 6, 8])
        return cfg
    # parallel3d: a world the layout fills
    tp, pp = rnd.choice([1, 2, 4]), rnd.choice([1, 2])
    if world is not None:
        tp, pp = rnd.choice([(t, p) for t in (1, 2) for p in (1, 2) if world % (t * p) == 0])
    dp_actual = world // (tp * pp) if world is not None else rnd.choice([1, 2])
    if pp > 1:
        # gloo runs the V schedule from torch 2.13 on; before, the strategy refuses it there
        schedule = rnd.choice([s for s in SCHEDULES if s != "zbv_zero_bubble" or zbv_runs_on_gloo()])
        fixed = SCHEDULES[schedule][2]
        stages_per_rank = fixed or rnd.choice([1, 2])
    else:
        schedule = rnd.choice(["gpipe", "1f1b", *SCHEDULES_ANY_STAGES])
        stages_per_rank = 1
    stages = pp * stages_per_rank
    if pp > 1:
        if SCHEDULES[schedule][1] == "single":
            m = rnd.choice([None, pp, 2 * pp] + ([1] if schedule == "gpipe" else []))
        else:  # rounds of pp: a multiple of pp
            m = rnd.choice([None, pp, 2 * pp])
        microbatches = m or max(pp, stages)
    else:
        m, microbatches = rnd.choice([None, 1, 2]), 1
    zero_stage = rnd.choice([0, 1, 2, 3])
    checkpointing = ["none", "full"] + ([] if pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES else ["selective"])
    model = _model(rnd, tp=tp, stages=stages)
    if SCHEDULES[schedule][1] == "v" and zero_stage > 0 and dp_actual > 1:
        model["tie_embeddings"] = False  # V placement cannot shard one tied parameter for two stages
    cfg["strategy"] = {
        "data_parallel_size": rnd.choice([dp_actual, "auto"]),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "zero_stage": zero_stage,
        "pipeline_schedule": schedule,
        "num_microbatches": m,
        "stages_per_rank": stages_per_rank,
        "sequence_parallel": rnd.choice([True, False]),  # seq_len (4, 8, 16) divides over tp (1, 2, 4)
        "activation_checkpointing": rnd.choice(checkpointing),
    }
    cfg["world"] = dp_actual * tp * pp
    cfg["model"] = model
    cfg["batch_size"] = microbatches * rnd.choice([1, 2])
    return cfg


# ---- planted invalid values: (name, applies to, mutate, words of the refusal) --------------------


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(cfg: dict) -> None:
        *parents, leaf = path.split(".")
        target = cfg
        for p in parents:
            target = target[p]
        target[leaf] = value

    return mutate


def _bad_world(cfg: dict) -> None:
    s = cfg["strategy"]
    model_ranks = s["tensor_parallel_size"] * s["pipeline_parallel_size"]
    cfg["world"] = cfg["world"] + 1 if s["data_parallel_size"] != "auto" else model_ranks + 1


def _partial_pipeline(cfg: dict) -> None:
    s = cfg["strategy"]
    cfg["model"]["n_layer"] = s["pipeline_parallel_size"] * s["stages_per_rank"] + 1


def _microbatches(cfg: dict) -> int:
    s = cfg["strategy"]
    return s["num_microbatches"] or max(s["pipeline_parallel_size"], s["pipeline_parallel_size"] * s["stages_per_rank"])


def _uneven_microbatches(cfg: dict) -> None:
    cfg["batch_size"] = _microbatches(cfg) + 1


def _heads_split_unevenly(cfg: dict) -> None:
    cfg["model"].update(n_kv_head=1)


def _seq_over_block(cfg: dict) -> None:
    cfg["seq_len"] = cfg["model"]["block_size"] * 2


def _indivisible_width(cfg: dict) -> None:
    cfg["model"]["n_embd"] = cfg["model"]["n_head"] * 8 + 1


ZERO, P3D, ANY = ("zero",), ("parallel3d",), ("zero", "parallel3d")
PLANTED: list[tuple[str, tuple, Callable[[dict], None], tuple[str, ...]]] = [
    ("n_layer=0", ANY, _set("model.n_layer", 0), ("n_layer",)),
    ("n_layer=-1", ANY, _set("model.n_layer", -1), ("n_layer",)),
    ("n_head=0", ANY, _set("model.n_head", 0), ("n_head",)),
    ("n_head=3", ANY, _set("model.n_head", 3), ("n_head",)),
    ("n_kv_head=0", ANY, _set("model.n_kv_head", 0), ("n_kv_head",)),
    ("n_kv_head=3", ANY, _set("model.n_kv_head", 3), ("n_kv_head",)),
    ("n_embd=0", ANY, _set("model.n_embd", 0), ("n_embd",)),
    ("vocab_size=0", ANY, _set("model.vocab_size", 0), ("vocab_size",)),
    ("pad_vocab_multiple=0", ANY, _set("model.pad_vocab_multiple", 0), ("pad_vocab_multiple",)),
    ("block_size=0", ANY, _set("model.block_size", 0), ("block_size",)),
    ("positions=sinusoid", ANY, _set("model.positions", "sinusoid"), ("positions",)),
    ("activation=relu2", ANY, _set("model.activation", "relu2"), ("activation",)),
    ("norm=batchnorm", ANY, _set("model.norm", "batchnorm"), ("norm",)),
    ("batch_size=0", ANY, _set("batch_size", 0), ("batch_size",)),
    ("seq_len=0", ANY, _set("seq_len", 0), ("seq_len",)),
    ("seq_len > block_size", ANY, _seq_over_block, ("block_size",)),
    ("precision=64-true", ANY, _set("precision", "64-true"), ("precision", "64-true")),
    ("precision=fp8", ANY, _set("precision", "fp8"), ("precision", "fp8")),
    ("stage=0", ZERO, _set("strategy.stage", 0), ("stage",)),
    ("stage=4", ZERO, _set("strategy.stage", 4), ("stage",)),
    ("gradient_compression=int8", ZERO, _set("strategy.gradient_compression", "int8"), ("gradient_compression",)),
    ("prefetch=-1", ZERO, _set("strategy.prefetch", -1), ("prefetch",)),
    ("init=lazy", ZERO, _set("strategy.init", "lazy"), ("init",)),
    ("backend=megatron", ZERO, _set("strategy.backend", "megatron"), ("backend",)),
    ("data_parallel_size=0", P3D, _set("strategy.data_parallel_size", 0), ("data_parallel_size",)),
    ("tensor_parallel_size=0", P3D, _set("strategy.tensor_parallel_size", 0), ("tensor_parallel_size",)),
    ("pipeline_parallel_size=0", P3D, _set("strategy.pipeline_parallel_size", 0), ("pipeline_parallel_size",)),
    ("zero_stage=4", P3D, _set("strategy.zero_stage", 4), ("zero_stage",)),
    ("pipeline_schedule=dualpipe", P3D, _set("strategy.pipeline_schedule", "dualpipe"), ("pipeline_schedule",)),
    ("num_microbatches=0", P3D, _set("strategy.num_microbatches", 0), ("num_microbatches",)),
    ("activation_checkpointing=some", P3D, _set("strategy.activation_checkpointing", "some"),
     ("activation_checkpointing",)),

]
# planted where the layout makes them impossible (each needs the property it names)
PLANTED_IF: list[tuple[str, Callable[[dict], bool], Callable[[dict], None], tuple[str, ...]]] = [
    ("n_embd not divisible by n_head", lambda c: c["model"]["n_head"] > 1, _indivisible_width, ("n_embd",)),
    ("a world the layout does not fill", lambda c: c["kind"] == "parallel3d" and (
        c["strategy"]["data_parallel_size"] != "auto"
        or c["strategy"]["tensor_parallel_size"] * c["strategy"]["pipeline_parallel_size"] > 1),
     _bad_world, ("world size",)),
    ("offload_params below stage 3", lambda c: c["kind"] == "zero" and c["strategy"]["stage"] < 3,
     _set("strategy.offload_params", True), ("offload_params",)),
    ("reshard_after_forward below stage 3", lambda c: c["kind"] == "zero" and c["strategy"]["stage"] < 3,
     _set("strategy.reshard_after_forward", True), ("reshard_after_forward",)),
    ("gradient_compression above stage 1", lambda c: c["kind"] == "zero" and c["strategy"]["stage"] > 1,
     _set("strategy.gradient_compression", "fp16"), ("gradient_compression",)),
    ("gradient_compression=bf16 on the CPU", lambda c: c["kind"] == "zero" and c["strategy"]["stage"] == 1,
     _set("strategy.gradient_compression", "bf16"), ("gradient_compression='bf16'",)),
    ("heads split unevenly over tp", lambda c: c["kind"] == "parallel3d" and c["strategy"]["tensor_parallel_size"] > 1,
     _heads_split_unevenly, ("n_kv_head", "tensor_parallel_size")),
    ("blocks that do not fill the stages",
     lambda c: c["kind"] == "parallel3d" and c["strategy"]["pipeline_parallel_size"] > 1,
     _partial_pipeline, ("n_layer",)),
    ("a batch the microbatches do not divide",
     lambda c: c["kind"] == "parallel3d" and c["strategy"]["pipeline_parallel_size"] > 1 and _microbatches(c) > 1,
     _uneven_microbatches, ("batch size", "num_microbatches")),
    ("selective checkpointing under a split backward",
     lambda c: c["kind"] == "parallel3d" and c["strategy"]["pipeline_parallel_size"] > 1
     and c["strategy"]["pipeline_schedule"] in ("zero_bubble", "zbv_zero_bubble"),
     _set("strategy.activation_checkpointing", "selective"), ("selective",)),
    ("stages_per_rank without a pipeline",
     lambda c: c["kind"] == "parallel3d" and c["strategy"]["pipeline_parallel_size"] == 1,
     _set("strategy.stages_per_rank", 2), ("stages_per_rank",)),
]


def plant(rnd: random.Random, cfg: dict) -> tuple[str, dict, tuple[str, ...]]:
    """``cfg`` with one invalid value: (what was planted, the configuration, words its refusal must hold)."""
    options = [(n, m, w) for n, kinds, m, w in PLANTED if cfg["kind"] in kinds]
    options += [(n, m, w) for n, applies, m, w in PLANTED_IF if applies(cfg)]
    name, mutate, words = rnd.choice(options)
    bad = copy.deepcopy(cfg)
    mutate(bad)
    return name, bad, words


# ---- mixed: every value drawn on its own ---------------------------------------------------------


def _pick(rnd: random.Random, valid: list, invalid: list = ()) -> Any:
    """A valid value, or (1 time in 24, when there are any) an impossible one."""
    if invalid and rnd.random() < 1 / 24:
        return rnd.choice(list(invalid))
    return rnd.choice(valid)


def mixed_config(rnd: random.Random) -> dict:
    from lightning_perf.parallel.model_parallel.pipeline import SCHEDULES

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
    return cfg


# ---- what a run does before its process group ----------------------------------------------------


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


def check_before_process_group(cfg: dict) -> None:
    """Raise ``ReachedProcessGroup`` if every check passes, else what the user would see."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. the pipeline bubble warning
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


def _outcome(cfg: dict) -> tuple[str, Optional[BaseException]]:
    """("accepted" | "refused" | "missing extra" | "other", the exception)."""
    try:
        check_before_process_group(cfg)
    except ReachedProcessGroup:
        return "accepted", None
    except ValueError as e:
        return ("refused" if str(e) and _raised_by_us(e) else "other"), e
    except ImportError as e:
        named = "pip install" in str(e) or "deepspeed" in str(e).lower()
        return ("missing extra" if named else "other"), e
    except Exception as e:  # noqa: BLE001 - anything else is the failure this test looks for
        return "other", e
    raise AssertionError("unreachable")


def _trace(e: Optional[BaseException]) -> str:
    return "" if e is None else "".join(traceback.format_exception(e))[-3000:]


# ---- the properties ------------------------------------------------------------------------------


def test_valid_configs_are_accepted() -> None:
    rnd = _rng("valid")
    kinds: Counter = Counter()
    for _ in range(N_VALID):
        cfg = valid_config(rnd)
        outcome, e = _outcome(cfg)
        assert outcome == "accepted", f"a valid configuration was {outcome} {REPLAY}:\n{cfg}\n{_trace(e)}"
        kinds[(cfg["kind"], cfg["world"])] += 1
    print(f"valid configurations accepted: {dict(kinds)}")


def test_each_planted_invalid_value_is_refused_before_the_process_group() -> None:
    rnd = _rng("planted")
    planted: Counter = Counter()
    for _ in range(N_PLANTED):
        name, cfg, words = plant(rnd, valid_config(rnd))
        outcome, e = _outcome(cfg)
        assert outcome == "refused", f"planted {name}: {outcome} {REPLAY}:\n{cfg}\n{_trace(e)}"
        message = str(e).lower()
        assert any(w.lower() in message for w in words), (
            f"planted {name}: refused for another reason {REPLAY} (expected one of {words}):\n{cfg}\n{e}")
        planted[name] += 1
    print(f"planted and refused: {dict(planted)}")
    assert len(planted) >= 10  # many kinds of bad value, not one over and over


def test_mixed_configs_are_accepted_or_refused_clearly(record_property) -> None:
    rnd = _rng("mixed")
    counts: Counter = Counter()
    for _ in range(N_MIXED):
        cfg = mixed_config(rnd)
        outcome, e = _outcome(cfg)
        assert outcome != "other", f"neither accepted nor refused clearly {REPLAY}:\n{cfg}\n{_trace(e)}"
        counts[outcome] += 1
    print(f"mixed configurations: {dict(counts)}")
    record_property("configs_tried", N_VALID + N_PLANTED + N_MIXED)
    assert counts["accepted"] > 0 and counts["refused"] > 0


def _train(rank: int, world: int, out: Path, cfgs: list[dict]) -> list[Any]:
    import lightning as L

    results = []
    for cfg in cfgs:
        L.seed_everything(0, verbose=False)
        strategy, module, data = build(cfg, real=True)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, data)
        results.append(float(trainer.callback_metrics["train/loss"]))
    return results


def training_sample(rnd: random.Random) -> list[dict]:
    """Valid 2-rank configurations: ZeRO, and a 3D layout with a pipeline or tensor parallelism."""
    wanted = {
        "zero": lambda c: c["kind"] == "zero",
        "3d": lambda c: c["kind"] == "parallel3d"
        and c["strategy"]["pipeline_parallel_size"] * c["strategy"]["tensor_parallel_size"] == 2,
    }
    chosen: dict[str, dict] = {}
    while len(chosen) < len(wanted):
        cfg = valid_config(rnd, kind=rnd.choice(["zero", "parallel3d"]), world=2)
        for name, fits in wanted.items():
            if name not in chosen and fits(cfg):
                chosen[name] = cfg
                break
    return list(chosen.values())


def test_valid_configs_train_a_step(tmp_path) -> None:
    sample = training_sample(_rng("train"))
    for cfg in sample:
        outcome, e = _outcome(cfg)
        assert outcome == "accepted", f"{cfg} {REPLAY}\n{_trace(e)}"
    print("training a step of:", [(c["kind"], c["strategy"], c["batch_size"], c["seq_len"]) for c in sample])
    run = launch(_train, 2, tmp_path, sample, timeout=120)
    assert all(c == 0 for c in run.exitcodes), (sample, run.errors, REPLAY)
    for losses in run.results:
        assert len(losses) == len(sample) and all(torch.isfinite(torch.tensor(losses))), (losses, REPLAY)
