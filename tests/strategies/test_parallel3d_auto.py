"""The pipeline Parallel3DStrategy chooses by default ("auto") trains as one process does.

Two gloo ranks, pp2, the tiny Llama-style GPT of ``test_parallel3d`` (4 blocks) on its global batch of
8 sequences of 16 tokens, 3 steps, against the one-process run of the same seed (losses rtol 1e-4 and
final parameters):

- with a data module that states ``batch_size`` and ``seq_len``, the shape is known before the model is
  split: interleaved 1F1B on 2 stages per rank, 2 microbatches (the batch is far below the token floor,
  so the fewest that keep every rank busy: pp);
- with plain loaders, one stage per rank and the schedule chosen at the first batch; a 32-token floor
  gives 4 microbatches of 2 sequences: 1F1B.

And the runner refuses a training batch of another shape than its first (a shorter last batch) on both
ranks with the numbers, where torch's stages would fail in a send/recv, while an evaluation batch of
another shape (fewer sequences, shorter sequences) gives the one-process loss, for one stage per rank
and for interleaved stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _spawn import spawn
from test_parallel3d import GLOBAL_B, PER_EPOCH, T, S, _check_run, fit, tiny_config


def _worker(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    shaped = S(pipeline_parallel_size=2)
    res["datamodule"] = fit(shaped, world, datamodule=True, steps=PER_EPOCH)
    res["datamodule_choice"] = shaped.pipeline_choice
    loaders = S(pipeline_parallel_size=2, min_microbatch_tokens=2 * T)
    res["loaders"] = fit(loaders, world, steps=PER_EPOCH, val_sequences=GLOBAL_B + 3)  # validation: 8 + 3
    res["loaders_choice"] = loaders.pipeline_choice
    return res


@pytest.mark.slow
def test_auto_pipeline_matches_one_process(tmp_path) -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_perf.parallel.model_parallel.pipeline import PipelineChoice

    ref = fit(SingleDeviceStrategy(torch.device("cpu")), 1, steps=PER_EPOCH)
    ref_val = fit(SingleDeviceStrategy(torch.device("cpu")), 1, steps=PER_EPOCH, val_sequences=GLOBAL_B + 3)["val"]
    results = spawn(_worker, 2, tmp_path, timeout=240.0)
    base = dict(pipeline_parallel_size=2, batch_size=GLOBAL_B, seq_len=T)
    for r in results:
        assert r["datamodule_choice"] == PipelineChoice(schedule="interleaved_1f1b", num_microbatches=2,
                                                        stages_per_rank=2, **base)
        assert r["loaders_choice"] == PipelineChoice(schedule="1f1b", num_microbatches=4, stages_per_rank=1, **base)
    _check_run(results, "datamodule", ref)
    _check_run(results, "loaders", ref)
    # validation's short last batch (3 sequences) ran through a forward-only schedule of its own
    for r in results:
        assert r["loaders"]["val"] == pytest.approx(ref_val, rel=1e-5)
    # the choice, once per fit, on rank 0's console
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    line = "pipeline: interleaved_1f1b, 2 stages per rank, 2 microbatches of 4 sequences (64 tokens); " \
           "theoretical bubble 20%"
    assert logs[0].count(line) == 1 and line not in logs[1], logs[0][-3000:]
    assert logs[0].count("pipeline: 1f1b, 1 stage per rank, 4 microbatches of 2 sequences (32 tokens); "
                         "theoretical bubble 20%") == 1


def _shape_worker(rank: int, world: int, out: Path) -> dict:
    import copy

    import torch.distributed as dist

    from lightning_perf.models.gpt import GPT
    from lightning_perf.parallel.model_parallel.pipeline import (
        PipelineConfig,
        PipelineRunner,
        build_stage_modules,
        choose_schedule,
    )

    res: dict[str, Any] = {}
    cases = (("as_set", "1f1b", 1, None), ("auto", "1f1b", 1, lambda b, t: choose_schedule(2, b, t, None)),
             ("interleaved", "interleaved_1f1b", 2, None))
    for name, schedule, stages_per_rank, choose in cases:
        torch.manual_seed(0)
        model = GPT(tiny_config())
        reference = copy.deepcopy(model)
        config = PipelineConfig(pipeline_parallel_size=2, schedule=schedule, num_microbatches=2,
                                stages_per_rank=stages_per_rank)
        stages = build_stage_modules(model, rank, config)
        runner = PipelineRunner(config, stages, dist.group.WORLD, torch.device("cpu"), choose=choose)
        x = torch.randint(0, 64, (GLOBAL_B, T))
        # evaluation before any training (Lightning's sanity check) on a short batch: it must not fix the
        # training batches' shape (nor, under "auto", choose their schedule)
        with torch.no_grad():
            before = (runner.eval_step(x[:3], x[:3]).item(), reference(x[:3], x[:3]).item())
        res[name] = [runner.train_step(x, x).item()]
        try:  # half a batch: divisible by the 2 microbatches, but not the shape the stages were set up for
            runner.train_step(x[: GLOBAL_B // 2], x[: GLOBAL_B // 2])
        except ValueError as e:
            res[name].append(str(e))
        res[name].append(runner.eval_step(x, x).item())  # the group still works
        # a shorter last validation batch (3 sequences: no 2 microbatches divide it) and a shorter sequence
        # run through a forward-only schedule of their own; the gradients above left the weights as they were
        with torch.no_grad():
            for short in (x[:3], x[:, : T // 2]):
                res[name].append((runner.eval_step(short, short).item(), reference(short, short).item()))
        res[name].append(runner.train_step(x, x).item())  # training goes on with its own schedule
        res[name].append(before)
        res[name].append(runner.choice.as_dict())
    return res


@pytest.mark.slow
def test_a_batch_of_another_shape_is_refused_in_training_and_evaluated_in_validation(tmp_path) -> None:
    results = spawn(_shape_worker, 2, tmp_path, timeout=120.0, init_group=True)
    for name in ("as_set", "auto", "interleaved"):
        (loss0, error0, eval0, *short0, again0, before0, choice0), (loss1, error1, eval1, *short1, again1, before1,
                                                                  choice1) = (r[name] for r in results)
        assert choice0 == choice1 and choice0["batch_size"] == GLOBAL_B and choice0["num_microbatches"] == 2
        assert before0 == before1 and before0[0] == pytest.approx(before0[1], rel=1e-5)
        assert loss0 == loss1 and eval0 == eval1 and 4.0 < eval0 < 5.5, results
        assert again0 == again1 == pytest.approx(loss0, rel=1e-6)
        assert error0 == error1
        assert "a batch of 4 sequences x 16 tokens after batches of 8 x 16" in error0, error0
        assert "drop_last=True" in error0
        assert short0 == short1
        for pipelined, one_process in short0:
            assert pipelined == pytest.approx(one_process, rel=1e-5), (name, short0)
