"""The model's layout check is asked through its config (``check_parallel_layout``), by numbers alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lightning_perf.models.gpt import GPTConfig
from lightning_perf.parallel.layout.config_3d import Parallel3DConfig, check_model_config


@dataclass
class _UserConfig:
    n_blocks: int = 6
    calls: list = None

    def check_parallel_layout(self, *, tensor_parallel_size: int, pipeline_parallel_size: int,
                              stages_per_rank: int) -> None:
        self.calls = (self.calls or []) + [(tensor_parallel_size, pipeline_parallel_size, stages_per_rank)]
        if self.n_blocks % (pipeline_parallel_size * stages_per_rank):
            raise ValueError(f"{self.n_blocks} blocks do not fill the stages")


def test_user_config_is_asked_with_the_layout() -> None:
    cfg = _UserConfig()
    check_model_config(cfg, Parallel3DConfig(tensor_parallel_size=2))
    check_model_config(cfg, Parallel3DConfig(pipeline_parallel_size=3, stages_per_rank=2,
                                             pipeline_schedule="interleaved_1f1b", num_microbatches=6))
    assert cfg.calls == [(2, 1, 1), (1, 3, 2)]
    with pytest.raises(ValueError, match="6 blocks do not fill the stages"):
        check_model_config(cfg, Parallel3DConfig(pipeline_parallel_size=4))


def test_configs_without_the_method_are_left_to_the_model() -> None:
    @dataclass
    class GPTShaped:  # GPT-like fields, but no layout check of its own
        n_head: int = 3
        n_kv_head: int = 3
        n_layer: int = 3
        tie_embeddings: bool = True
        intermediate_size: int = 3
        padded_vocab_size: int = 3

    check_model_config(GPTShaped(), Parallel3DConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    check_model_config(None, Parallel3DConfig(tensor_parallel_size=2))


def test_gpt_config_check_matches_the_layout() -> None:
    cfg = GPTConfig.from_name("tiny-llama", tie_embeddings=False)  # 4 heads, 2 kv heads, 4 layers
    cfg.check_parallel_layout(tensor_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2)
    with pytest.raises(ValueError, match=r"n_kv_head \(2\) is not divisible by tensor_parallel_size \(4\): 2 / 4"):
        cfg.check_parallel_layout(tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"pp\(3\) \* stages_per_rank\(1\) = 3, 4 / 3 = 1.33"):
        check_model_config(cfg, Parallel3DConfig(pipeline_parallel_size=3))


def test_zero_bubble_schedules_refuse_selective_checkpointing() -> None:
    """Their split backward (input, then weight gradients) ran a second backward through a selectively
    checkpointed region, which torch refused in the first step; now the layout is refused up front."""
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig

    for schedule, stages in (("zero_bubble", 1), ("zero_bubble", 2), ("zbv_zero_bubble", 2)):
        with pytest.raises(ValueError, match=rf"pipeline_schedule='{schedule}' runs each backward as two passes"):
            Parallel3DConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, stages_per_rank=stages,
                             activation_checkpointing="selective")
        for ac in ("full", "none"):  # these train (tests/reliability/test_bad_input.py draws them)
            Parallel3DConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, stages_per_rank=stages,
                             activation_checkpointing=ac)
    Parallel3DConfig(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", stages_per_rank=2,
                     activation_checkpointing="selective")
    # without a pipeline the schedule never runs
    Parallel3DConfig(pipeline_schedule="zero_bubble", activation_checkpointing="selective")


def test_pipeline_values_default_to_auto() -> None:
    from lightning_perf.parallel.layout.config_3d import settle_pipeline

    cfg = Parallel3DConfig(pipeline_parallel_size=2)
    assert (cfg.pipeline_schedule, cfg.num_microbatches, cfg.stages_per_rank) == ("auto", "auto", "auto")
    assert cfg.pipeline_auto and cfg.pipeline is None  # settled from the model and the batch
    # without a pipeline there is nothing to choose
    assert not Parallel3DConfig().pipeline_auto and Parallel3DConfig().pipeline is not None
    # explicit values everywhere: the pipeline as before, nothing to settle
    explicit = Parallel3DConfig(pipeline_parallel_size=2, pipeline_schedule="1f1b", num_microbatches=None,
                                stages_per_rank=1)
    assert not explicit.pipeline_auto and explicit.pipeline.num_microbatches == 2
    assert settle_pipeline(explicit).config is explicit

    # gpt-1.3b-pp2's numbers, before the model exists (its config tells the blocks)
    gpt = GPTConfig.from_name("gpt-1.3b", tie_embeddings=False)
    settled = settle_pipeline(cfg, None, gpt, batch_size=16, seq_len=2048)
    assert settled.final and settled.choice is not None
    assert (settled.config.pipeline_schedule, settled.config.num_microbatches, settled.config.stages_per_rank) == \
        ("interleaved_1f1b", 4, 2)
    assert settled.config.pipeline.num_stages == 4
    assert settled.choose(16, 2048) == settled.choice  # the first batch of that shape keeps the choice
    # no batch shape yet: one stage per rank, the rest at the first batch (with those stages)
    later = settle_pipeline(cfg, None, gpt)
    assert not later.final and later.choice is None and later.config.stages_per_rank == 1
    first = later.choose(16, 2048)
    assert (first.schedule, first.num_microbatches, first.stages_per_rank) == ("1f1b", 4, 1)
    # a model whose own layout check refuses 2 stages per rank is not interleaved
    user = _UserConfig(n_blocks=6)  # its check: 6 blocks do not fill pp2 x 2 stages = 4
    user.n_layer = 8  # though 8 layers would
    assert settle_pipeline(cfg, None, user, batch_size=16, seq_len=2048).config.stages_per_rank == 1
    user.n_blocks = 8
    assert settle_pipeline(cfg, None, user, batch_size=16, seq_len=2048).config.stages_per_rank == 2
    # the floor is an option: 8 microbatches of 2 x 2048
    small = Parallel3DConfig(pipeline_parallel_size=2, min_microbatch_tokens=4096)
    assert settle_pipeline(small, None, gpt, batch_size=16, seq_len=2048).config.num_microbatches == 8


def test_explicit_pipeline_values_are_refused_when_built() -> None:
    cases = [
        (dict(num_microbatches=0), "num_microbatches must be 'auto', None or a positive integer, got 0"),
        (dict(num_microbatches="many"), "num_microbatches must be 'auto', None or a positive integer"),
        (dict(stages_per_rank=0), "stages_per_rank must be a positive integer"),
        (dict(min_microbatch_tokens=0), "min_microbatch_tokens must be a positive integer"),
        (dict(pipeline_schedule="1f1b", stages_per_rank=2), r"runs exactly 1 stage\(s\) per rank"),
        (dict(stages_per_rank=2, num_microbatches=1), r"needs num_microbatches >= pp: 1 < 2"),
        (dict(pipeline_schedule="interleaved_1f1b", num_microbatches=5), r"not a multiple of 2 rounds"),
        (dict(pipeline_schedule="zero_bubble", activation_checkpointing="selective"), "runs each backward as two"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            Parallel3DConfig(pipeline_parallel_size=2, **kwargs)
    with pytest.raises(ValueError, match="stages_per_rank=2 needs pipeline_parallel_size > 1"):
        Parallel3DConfig(stages_per_rank=2)


@pytest.mark.parametrize("name, expected", [
    # 16 x 2048 per replica, 24 blocks: 4 microbatches of 4 sequences, interleaved on 2 stages per rank
    ("gpt-1.3b-pp2", ("interleaved_1f1b", 4, 2, 8192)),
    # 8 x 4096 per replica (dp2 x tp2 x pp2), 32 blocks: 4 microbatches of 2 sequences, interleaved
    ("llama-8b-3d", ("interleaved_1f1b", 4, 2, 8192)),
])
def test_the_pipeline_recipes_leave_the_schedule_to_auto(name, expected) -> None:
    import yaml

    from lightning_perf.cli import recipe_dir
    from lightning_perf.parallel.layout.config_3d import settle_pipeline

    recipe = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    args = recipe["trainer"]["strategy"]["init_args"]
    assert not {"pipeline_schedule", "num_microbatches", "stages_per_rank"} & set(args), args
    config = Parallel3DConfig(**{k: v for k, v in args.items() if k != "meta_init"})
    model = recipe["model"]["config"]
    model = GPTConfig.from_name(model) if isinstance(model, str) else GPTConfig(**model)
    data = recipe["data"]
    batch = data["batch_size"]
    if batch == "auto":  # the planner gives each replica its share of the global batch (a pipeline splits it)
        devices = recipe["trainer"]["devices"]
        dp = config.dims(devices).data_parallel_size
        batch = data["global_batch_size"] * devices // data.get("global_batch_per_gpus", devices) // dp
    choice = settle_pipeline(config, None, model, batch_size=batch, seq_len=data["seq_len"]).choice
    assert (choice.schedule, choice.num_microbatches, choice.stages_per_rank, choice.microbatch_tokens) == expected
    assert choice.bubble == pytest.approx(1 / 9)
