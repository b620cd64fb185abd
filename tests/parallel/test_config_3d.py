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
