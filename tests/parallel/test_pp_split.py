"""Pipeline pieces without a process group: schedule checks, placement, the GPT split."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.models.gpt import GPT, GPTConfig, ops
from lightning_perf.parallel.model_parallel.pipeline import (
    PipelineConfig,
    bubble_fraction,
    build_stage_modules,
    lm_cross_entropy,
    prune_to_stages,
    stage_indices,
    stage_loss,
    stage_owner,
)


def _cfg(**kw) -> GPTConfig:
    base = dict(name="t", vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
                intermediate_size=64, pad_vocab_multiple=16, norm="rmsnorm", activation="swiglu",
                positions="rope", tie_embeddings=False, bias=False)
    base.update(kw)
    return GPTConfig(**base)


def test_schedule_errors_show_the_numbers() -> None:
    with pytest.raises(ValueError, match="unknown pipeline_schedule 'zb'"):
        PipelineConfig(pipeline_parallel_size=2, schedule="zb")
    with pytest.raises(ValueError, match=r"needs num_microbatches >= pp: 2 < 4"):
        PipelineConfig(pipeline_parallel_size=4, schedule="interleaved_1f1b", stages_per_rank=2, num_microbatches=2)
    with pytest.raises(ValueError, match="not a multiple of 2 rounds"):
        PipelineConfig(pipeline_parallel_size=4, schedule="interleaved_1f1b", stages_per_rank=2,
                       num_microbatches=10 - 1)
    with pytest.raises(ValueError, match="runs exactly 1 stage"):
        PipelineConfig(pipeline_parallel_size=2, schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by num_microbatches 4"):
        PipelineConfig(pipeline_parallel_size=2, num_microbatches=4).check_batch(6)
    with pytest.warns(UserWarning, match=r"num_microbatches \(2\) < total pipeline stages"):
        PipelineConfig(pipeline_parallel_size=2, schedule="interleaved_1f1b", stages_per_rank=2, num_microbatches=2)
    interleaved = PipelineConfig(pipeline_parallel_size=2, schedule="interleaved_1f1b", stages_per_rank=2)
    assert interleaved.num_microbatches == 4


def test_placement_loop_and_v() -> None:
    assert stage_indices(1, 4, 2, "loop") == [1, 5]
    assert stage_indices(1, 4, 2, "v") == [1, 6]
    assert stage_indices(0, 4, 2, "v") == [0, 7]  # the V puts first and last stage on rank 0
    assert [stage_owner(s, 4, "loop") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_owner(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    zbv = PipelineConfig(pipeline_parallel_size=2, schedule="zbv_zero_bubble", stages_per_rank=2)
    assert zbv.last_stage_rank() == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


def test_stages_chain_to_the_full_model_and_keep_names() -> None:
    torch.manual_seed(0)
    model = GPT(_cfg())
    idx = torch.randint(0, 64, (2, 16))
    full = model(idx)
    stages = [model.pipeline_stage(i, 4) for i in range(4)]
    x = idx
    for s in stages:
        x = s(x)
    # the last stage hands on the final norm's output: its loss applies the head (one compiled / fused region)
    assert x.shape == (2, 16, model.config.n_embd) and [s.head_in_loss for s in stages] == [False] * 3 + [True]
    torch.testing.assert_close(ops.lm_logits(x, stages[3].head_weight), full)
    targets = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(stages[3].pipeline_loss(x, targets), model(idx, targets))
    assert stage_loss(stages[3]) == stages[3].pipeline_loss and stage_loss(None) is lm_cross_entropy
    with pytest.raises(RuntimeError, match="pipeline's last stage"):
        model.pipeline_loss(x, targets)  # the whole model's forward returns logits
    assert list(stages[1].blocks.keys()) == ["1"] and stages[1].tok_emb is None and stages[1].norm is None
    assert stages[3].lm_head is model.lm_head
    # rank 1 of pp=2 with two stages per rank (loop placement) runs stages 1 and 3
    names = set(model.state_dict())
    interleaved = PipelineConfig(pipeline_parallel_size=2, schedule="interleaved_1f1b", stages_per_rank=2)
    local = build_stage_modules(model, 1, interleaved)
    assert sorted(local) == [1, 3]
    prune_to_stages(model, local)
    kept = set(model.state_dict())
    assert kept <= names
    assert {k.split(".")[1] for k in kept if k.startswith("blocks.")} == {"1", "3"}
    assert "lm_head.weight" in kept and "tok_emb.weight" not in kept


def test_tied_head_is_shared_by_the_first_and_last_stage() -> None:
    model = GPT(_cfg(tie_embeddings=True))
    first, last = model.pipeline_stage(0, 2), model.pipeline_stage(1, 2)
    assert first.tok_emb is model.tok_emb and first.lm_head is None
    assert last.tok_emb is None and last.lm_head is model.tok_emb
    assert last.head_weight is model.tok_emb.weight
    assert model.pipeline_stage(0, 1).head_weight is model.tok_emb.weight
    # the last stage's rank keeps the embedding under its one name, as its head
    pruned = GPT(_cfg(tie_embeddings=True))
    stage = pruned.pipeline_stage(1, 2)
    prune_to_stages(pruned, {1: stage})
    kept = set(pruned.state_dict())
    assert "tok_emb.weight" in kept and "lm_head.weight" not in kept and "norm.weight" in kept
    assert {k.split(".")[1] for k in kept if k.startswith("blocks.")} == set(stage.blocks)
    with pytest.raises(ValueError, match=r"4 blocks do not split evenly into 3"):
        GPT(_cfg()).pipeline_stage(0, 3)


def test_stage_split_balances_the_lm_head() -> None:
    from lightning_perf.models.gpt import GPTConfig
    from lightning_perf.models.gpt.parallelize import _head_in_blocks, gpt_stage_layers

    cfg = GPTConfig.from_name("gpt-1.3b", tie_embeddings=False)
    h = _head_in_blocks(cfg)
    assert 1.5 < h < 2.5  # V*d = 103M against ~54M per block (matmuls + causal scores at T=2048)
    sizes = gpt_stage_layers(cfg, 2)
    assert sizes == [13, 11]
    # the slowest stage is faster than under the even split, which is what 1F1B waits on
    assert max(sizes[0], sizes[1] + h) < 12 + h
    for n in (2, 3, 4, 6, 8):
        split = gpt_stage_layers(cfg, n)
        assert sum(split) == 24 and min(split) >= 1 and split[-1] == min(split)
        even = max(24 / n, 24 / n + h)
        assert max(split[:-1] + [split[-1] + h]) <= even + 1e-9
    # tiny heads (the CPU test models) keep the even split
    tiny = GPTConfig.from_name("tiny-llama", tie_embeddings=False)
    assert gpt_stage_layers(tiny, 2) == [2, 2] and gpt_stage_layers(tiny, 4) == [1, 1, 1, 1]
    with torch.device("meta"):
        model = GPT(cfg.replace(n_layer=24))
    stages = [model.pipeline_stage(i, 2) for i in range(2)]
    assert [list(s.blocks) for s in stages] == [[str(i) for i in range(13)], [str(i) for i in range(13, 24)]]


# ---- "auto": choose_schedule, by hand ---------------------------------------------------------------


def _picked(*args, **kwargs) -> tuple[str, int, int]:
    from lightning_perf.parallel.model_parallel.pipeline import choose_schedule

    c = choose_schedule(*args, **kwargs)
    return c.schedule, c.num_microbatches, c.stages_per_rank


def test_auto_on_the_recipes_shapes() -> None:
    from lightning_perf.parallel.model_parallel.pipeline import choose_schedule

    # gpt-1.3b-pp2: 24 blocks, 16 x 2048 per replica. 8192-token floor: at most 4 microbatches (of 4
    # sequences); 24 blocks fill 2 * 2 stages, so interleaved 1F1B: bubble 1 / (2*4 + 1) = 11% (1F1B: 1/5)
    gpt = choose_schedule(2, 16, 2048, 24)
    assert (gpt.schedule, gpt.num_microbatches, gpt.stages_per_rank) == ("interleaved_1f1b", 4, 2)
    assert (gpt.microbatch_size, gpt.microbatch_tokens) == (4, 8192) and gpt.bubble == pytest.approx(1 / 9)
    assert gpt.describe() == ("pipeline: interleaved_1f1b, 2 stages per rank, 4 microbatches of 4 sequences "
                              "(8192 tokens); theoretical bubble 11%")
    # llama-8b-3d: 32 blocks, pp2 (x tp2 x dp2), 8 x 4096 per replica: 4 microbatches of 2 sequences
    assert _picked(2, 8, 4096, 32) == ("interleaved_1f1b", 4, 2)
    # the recipes as they were set by hand stay accepted as explicit values
    assert _picked(2, 16, 2048, 24, schedule="1f1b", num_microbatches=8, stages_per_rank=1) == ("1f1b", 8, 1)
    assert _picked(2, 8, 4096, 32, schedule="interleaved_1f1b", num_microbatches=8,
                   stages_per_rank=2) == ("interleaved_1f1b", 8, 2)


def test_auto_microbatch_rules_by_hand() -> None:
    # a smaller floor: 8 microbatches of 2 x 2048 (interleaved rounds: 8 // 2 = 4, 8 % 4 == 0)
    assert _picked(2, 16, 2048, 24, min_microbatch_tokens=4096) == ("interleaved_1f1b", 8, 2)
    # 2 x 2048 tokens, below the floor: still pp microbatches (one would idle a stage half the step)
    assert _picked(2, 2, 2048, 24) == ("interleaved_1f1b", 2, 2)
    # fewer sequences than stages: only GPipe runs fewer microbatches than pp; as many as there are
    assert _picked(4, 2, 2048, 32) == ("gpipe", 2, 1)
    assert _picked(2, 1, 2048, 24) == ("gpipe", 1, 1)
    # blocks that do not fill 2 * pp stages (or a model that cannot tell): one stage per rank, 1F1B
    assert _picked(2, 16, 2048, 22) == ("1f1b", 4, 1)
    assert _picked(2, 16, 2048, None) == ("1f1b", 4, 1)
    # 20 x 2048: the floor allows 5 microbatches, which interleaving cannot take in rounds of 2 (5 % 2);
    # interleaved at 4 (bubble 1/9) still beats 1F1B at 5 (1/6)
    assert _picked(2, 20, 2048, 24) == ("interleaved_1f1b", 4, 2)
    # pp4, 44 x 2048: 1F1B at the floor's 11 microbatches (bubble 3/14) beats interleaved, whose rounds of 4
    # allow only 4 of the divisors up to 11 (3/11)
    assert _picked(4, 44, 2048, 32) == ("1f1b", 11, 1)
    # 6 x 2048: no microbatch of at least pp keeps the floor; the fewest microbatches each schedule takes
    assert _picked(2, 6, 2048, 24) == ("interleaved_1f1b", 2, 2)


def test_auto_keeps_explicit_values() -> None:
    assert _picked(2, 16, 2048, 24, schedule="1f1b") == ("1f1b", 4, 1)
    assert _picked(2, 16, 2048, 24, schedule="gpipe") == ("gpipe", 4, 1)
    assert _picked(2, 16, 2048, 24, stages_per_rank=1) == ("1f1b", 4, 1)
    assert _picked(2, 16, 2048, 24, num_microbatches=8) == ("interleaved_1f1b", 8, 2)
    # None: one microbatch per stage, as PipelineConfig; interleaved (4 stages, 4 microbatches) wins
    assert _picked(2, 16, 2048, 24, num_microbatches=None) == ("interleaved_1f1b", 4, 2)
    # zero bubble only where asked for: the same microbatches, 2 stages per rank where the blocks allow
    assert _picked(2, 16, 2048, 24, schedule="zero_bubble") == ("zero_bubble", 4, 2)
    assert _picked(2, 16, 2048, 22, schedule="zero_bubble") == ("zero_bubble", 4, 1)
    assert _picked(2, 16, 2048, 24, schedule="zbv_zero_bubble") == ("zbv_zero_bubble", 4, 2)
    assert _picked(2, 16, 2048, 24, schedule="1f1b", num_microbatches=2, stages_per_rank=1) == ("1f1b", 2, 1)
    from lightning_perf.parallel.model_parallel.pipeline import choose_schedule

    assert not choose_schedule(2, 16, 2048, 24, schedule="1f1b", num_microbatches=4, stages_per_rank=1).auto
    assert choose_schedule(2, 16, 2048, 24, schedule="1f1b").auto


def test_auto_refuses_what_the_batch_cannot_run() -> None:
    from lightning_perf.parallel.model_parallel.pipeline import choose_schedule

    with pytest.raises(ValueError, match=r"pipeline_schedule='1f1b' with 1 stage\(s\) per rank needs at least pp=2 "
                                         r"microbatches .* a batch of 1 sequence"):
        choose_schedule(2, 1, 2048, 24, schedule="1f1b")
    with pytest.raises(ValueError, match=r"needs at least pp=2 microbatches"):
        choose_schedule(2, 1, 2048, 24, stages_per_rank=2)
    with pytest.raises(ValueError, match=r"batch size 16 is not divisible by num_microbatches 3"):
        choose_schedule(2, 16, 2048, 24, num_microbatches=3)
    with pytest.raises(ValueError, match=r"needs num_microbatches >= pp: 1 < 2"):
        choose_schedule(2, 16, 2048, 24, num_microbatches=1, stages_per_rank=2)
    with pytest.raises(ValueError, match=r"runs exactly 1 stage\(s\) per rank, got stages_per_rank=2"):
        choose_schedule(2, 16, 2048, 24, schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"unknown pipeline_schedule 'zb'"):
        choose_schedule(2, 16, 2048, 24, schedule="zb")
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer"):
        choose_schedule(2, 0, 2048, 24)


def test_auto_choice_is_kept_at_the_first_batch_and_runs() -> None:
    """The first batch chooses again with the stages the model was split into: on the same batch shape the
    choice is the same. Every choice is a schedule PipelineConfig takes and divides the batch."""
    from lightning_perf.parallel.model_parallel.pipeline import choose_schedule

    for pp in (2, 4):
        for batch in range(1, 33):
            for seq_len in (512, 2048):
                for blocks in (None, 24, 22, 32):
                    first = choose_schedule(pp, batch, seq_len, blocks)
                    again = choose_schedule(pp, batch, seq_len, blocks, stages_per_rank=first.stages_per_rank)
                    assert again == first, (pp, batch, seq_len, blocks)
                    config = first.config()
                    config.check_batch(batch)
                    assert first.num_microbatches >= min(pp, batch)
                    assert first.schedule != "gpipe" or batch < pp


def test_stages_are_settled_before_the_batch() -> None:
    from lightning_perf.parallel.model_parallel.pipeline import settle_before_batch

    # the batch decides whether to interleave: one stage per rank until it is known
    assert settle_before_batch(2, 24) == ("gpipe", None, 1, False)
    assert settle_before_batch(2, 24, schedule="interleaved_1f1b") == ("interleaved_1f1b", None, 2, False)
    assert settle_before_batch(2, 22, schedule="interleaved_1f1b") == ("interleaved_1f1b", None, 1, False)
    assert settle_before_batch(2, 24, stages_per_rank=2) == ("interleaved_1f1b", None, 2, False)
    # an explicit microbatch count leaves nothing to the batch
    assert settle_before_batch(2, 24, num_microbatches=8) == ("interleaved_1f1b", 8, 2, True)
    assert settle_before_batch(2, 24, num_microbatches=1) == ("gpipe", 1, 1, True)
