"""Bad input to Parallel3DStrategy fails with the numbers, before any process group exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_perf.models.gpt import GPT, GPTConfig
from lightning_perf.parallel.layout.config_3d import Parallel3DConfig, check_model
from lightning_perf.strategies.parallel3d import Parallel3DStrategy


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    assert not (dist.is_available() and dist.is_initialized()), "a process group was created"


def _meta_gpt(**kw) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.from_name("tiny-llama", **kw))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pipeline_schedule="zb1p"), "unknown pipeline_schedule 'zb1p'"),
        (dict(pipeline_parallel_size=2, num_microbatches="all"), "num_microbatches must be 'auto', None or a"),
        (dict(pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=1),
         r"needs num_microbatches >= pp: 1 < 2"),
        (dict(pipeline_parallel_size=2, pipeline_schedule="gpipe", stages_per_rank=2), r"runs exactly 1 stage"),
        (dict(pipeline_parallel_size=2, min_microbatch_tokens=-1), "min_microbatch_tokens must be a positive"),
        (dict(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", stages_per_rank=2,
              num_microbatches=2), r"needs num_microbatches >= pp: 2 < 4"),
        (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (dict(activation_checkpointing="some"), "activation_checkpointing='some'"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(stages_per_rank=2, pipeline_schedule="interleaved_1f1b"), "needs pipeline_parallel_size > 1"),
        (dict(fp8_all_gather=True, tensor_parallel_size=2), "with tensor parallelism"),
        (dict(fp8_all_gather=True, zero_stage=0), "needs data parallelism with ZeRO"),
        (dict(fp8_all_gather=True, data_parallel_size=1), "needs data parallelism with ZeRO"),
        (dict(fsdp_blocks_per_unit=0), "fsdp_blocks_per_unit must be an int >= 1, got 0"),
        (dict(fsdp_blocks_per_unit=True), "fsdp_blocks_per_unit must be an int >= 1, got True"),
        (dict(fsdp_blocks_per_unit=2, zero_stage=0), "needs zero_stage 1-3, got zero_stage=0"),
        (dict(context_parallel_size=0), "context_parallel_size must be a positive integer"),
        (dict(context_parallel_size=2, pipeline_parallel_size=2),
         r"context parallelism \(context_parallel_size=2\) does not combine with pipeline parallelism"),
        (dict(replicate_size=0), "replicate_size must be a positive int or 'auto'"),
        (dict(replicate_size="nodes"), "replicate_size must be a positive int or 'auto'"),
        (dict(replicate_size=2, zero_stage=0), r"replicate_size \(HSDP.*\) needs FSDP2: zero_stage 1-3, got zero_stage=0"),
        (dict(replicate_size="auto", zero_stage=0), "needs FSDP2: zero_stage 1-3"),
        (dict(replicate_size=2, fp8_all_gather=True), "fp8_all_gather with replicate_size != 1"),
        (dict(replicate_size=3, data_parallel_size=4),
         r"data_parallel_size 4 is not divisible by replicate_size 3: 4 / 3 = 1.33"),
    ],
)
def test_construction_rejects_bad_options(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Parallel3DStrategy(**kwargs)


def test_world_size_mismatch_fails_when_the_trainer_is_built() -> None:
    import lightning as L

    strategy = Parallel3DStrategy(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) \* pp\(3\) = 12 != world size 8"):
        L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)


def test_context_parallel_world_size_mismatch_shows_every_dimension() -> None:
    import lightning as L

    strategy = Parallel3DStrategy(data_parallel_size=2, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"pp\(1\) \* dp\(2\) \* cp\(2\) \* tp\(1\) = 4 != world size 8"):
        L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)


def test_hsdp_replicate_size_must_divide_the_data_parallel_size() -> None:
    import lightning as L

    # dp = 6 / tp 1 = 6 ranks, which 4 replicas cannot split: refused when the Trainer is built
    with pytest.raises(ValueError, match=r"data-parallel size 6 is not divisible by replicate_size 4: 6 / 4 = 1.5"):
        L.Trainer(accelerator="cpu", devices=6, strategy=Parallel3DStrategy(replicate_size=4), logger=False)
    # dp = 8 / (tp 2 * pp 2) = 2 ranks
    strategy = Parallel3DStrategy(replicate_size=4, tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"data-parallel size 2 is not divisible by replicate_size 4"):
        L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)
    # "auto" over 3 nodes of 2: 6 dp ranks in 3 replicas of 2, each a node
    auto = Parallel3DStrategy(replicate_size="auto")
    L.Trainer(accelerator="cpu", devices=2, num_nodes=3, strategy=auto, logger=False)
    dims = auto.config.dims(6, num_nodes=3)
    assert (dims.replicate_size, dims.shard_size) == (3, 2)
    tp3 = Parallel3DStrategy(replicate_size="auto", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"data-parallel size 2 is not divisible by replicate_size='auto' = "
                                         r"num_nodes \(3\)"):
        L.Trainer(accelerator="cpu", devices=2, num_nodes=3, strategy=tp3, logger=False)


def test_context_parallel_sequence_must_cut_into_2cp_chunks_before_launch() -> None:
    from types import SimpleNamespace

    from lightning_perf.models.gpt.module import GPTLightningModule

    strategy = Parallel3DStrategy(context_parallel_size=2, parallel_devices=[torch.device("cpu")] * 2)
    module = GPTLightningModule("tiny-llama")
    with pytest.raises(ValueError, match=r"2 \* cp = 4 chunks .*seq_len=18 / 4 = 4.5"):
        strategy._check_before_launch(module, SimpleNamespace(batch_size=2, seq_len=18))
    strategy._check_before_launch(module, SimpleNamespace(batch_size=2, seq_len=16))
    # with tensor parallelism, each cp rank's 2 chunks are split again over tp by sequence parallelism
    four_kv = GPTLightningModule(GPTConfig.from_name("tiny-llama", n_kv_head=4))
    cp_tp = Parallel3DStrategy(context_parallel_size=2, tensor_parallel_size=4, parallel_devices=[torch.device("cpu")] * 8)
    with pytest.raises(ValueError, match=r"seq_len / cp = 12 / 2 = 6 tokens, which sequence parallelism splits over tp=4"):
        cp_tp._check_before_launch(four_kv, SimpleNamespace(batch_size=4, seq_len=12))
    cp_tp._check_before_launch(four_kv, SimpleNamespace(batch_size=4, seq_len=16))


@pytest.mark.parametrize(
    "model_kw, cfg_kw, match",
    [
        (dict(n_head=8, n_kv_head=2), dict(tensor_parallel_size=4), r"n_kv_head \(2\) is not divisible"),
        (dict(n_head=6, n_kv_head=6, n_embd=384), dict(tensor_parallel_size=4), r"n_head \(6\) is not divisible"),
        (dict(), dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", stages_per_rank=3,
                      num_microbatches=6), r"n_layer \(4\) is not divisible by pipeline stages"),
    ],
)
def test_model_layout_checks(model_kw, cfg_kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_model(_meta_gpt(**model_kw), Parallel3DConfig(**cfg_kw))


def test_a_tied_head_passes_the_pipeline_check() -> None:
    model = _meta_gpt(tie_embeddings=True)
    assert check_model(model, Parallel3DConfig(pipeline_parallel_size=2)) is model


def test_user_model_without_protocol_gets_data_parallel_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert check_model(model, Parallel3DConfig(data_parallel_size=4)) is model
    wrapper = torch.nn.Module()
    wrapper.model = model  # a LightningModule-like holder: its inner network is what gets sharded
    assert check_model(wrapper, Parallel3DConfig(data_parallel_size=4)) is model
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp=2\) needs .*tensor_parallel_plan"):
        check_model(model, Parallel3DConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"pipeline parallelism \(pp=2\) needs .*pipeline_stage"):
        check_model(model, Parallel3DConfig(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match=r"context parallelism \(cp=2\) needs .*enable_context_parallel"):
        check_model(model, Parallel3DConfig(context_parallel_size=2))
    gpt = _meta_gpt()
    assert check_model(gpt, Parallel3DConfig(context_parallel_size=2)) is gpt


def test_module_config_is_checked_before_the_process_group() -> None:
    from lightning_perf.models.gpt.module import GPTLightningModule

    cpus = [torch.device("cpu")] * 4
    strategy = Parallel3DStrategy(tensor_parallel_size=4, parallel_devices=cpus)
    bad = GPTLightningModule(GPTConfig.from_name("tiny-llama", n_head=8, n_kv_head=2))
    with pytest.raises(ValueError, match=r"n_kv_head \(2\) is not divisible by tensor_parallel_size \(4\)"):
        strategy._check_before_launch(bad, None)
    ok = Parallel3DStrategy(tensor_parallel_size=2, parallel_devices=cpus[:2])
    ok._check_before_launch(GPTLightningModule("tiny-llama"), None)  # 4 heads, 2 kv heads: fine for tp=2


def test_auto_pipeline_is_settled_and_checked_before_the_process_group() -> None:
    """With a data module's batch shape, "auto" is settled in the launching process, and explicit values it
    cannot combine with that batch are refused there."""
    from types import SimpleNamespace

    from lightning_perf.models.gpt.module import GPTLightningModule

    cpus = [torch.device("cpu")] * 2
    module = GPTLightningModule(GPTConfig.from_name("tiny-llama", tie_embeddings=False))  # 4 blocks
    Parallel3DStrategy(pipeline_parallel_size=2, parallel_devices=cpus)._check_before_launch(
        module, SimpleNamespace(batch_size=1, seq_len=16))  # one sequence: GPipe, one microbatch
    with pytest.raises(ValueError, match=r"pipeline_schedule='1f1b' with 1 stage\(s\) per rank needs at least pp=2 "
                                         r"microbatches"):
        Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b", parallel_devices=cpus
                           )._check_before_launch(module, SimpleNamespace(batch_size=1, seq_len=16))
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by num_microbatches 4"):
        Parallel3DStrategy(pipeline_parallel_size=2, num_microbatches=4, parallel_devices=cpus
                           )._check_before_launch(module, SimpleNamespace(batch_size=6, seq_len=16))
    # 2 stages per rank asked for, which 6 blocks cannot fill: the model's check, before launch
    six = GPTLightningModule(GPTConfig.from_name("tiny-llama", tie_embeddings=False, n_layer=6))
    with pytest.raises(ValueError, match=r"n_layer \(6\) is not divisible by pipeline stages: pp\(2\) \* "
                                         r"stages_per_rank\(2\) = 4"):
        Parallel3DStrategy(pipeline_parallel_size=2, stages_per_rank=2, parallel_devices=cpus
                           )._check_before_launch(six, SimpleNamespace(batch_size=8, seq_len=16))
    # left to "auto", those 6 blocks run one stage per rank
    Parallel3DStrategy(pipeline_parallel_size=2, parallel_devices=cpus)._check_before_launch(
        six, SimpleNamespace(batch_size=8, seq_len=16))


@pytest.mark.parametrize("version, refused", [("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False)])
def test_zbv_on_gloo_is_refused_before_any_process_group(monkeypatch, version, refused) -> None:
    """Before torch 2.13 the V-shaped zero-bubble schedule sends to its own rank, which gloo refuses with
    "Pair is not connected" in the first step: the strategy says so before any process group instead."""
    import lightning as L

    from lightning_perf.parallel.model_parallel.pipeline import check_schedule_backend

    monkeypatch.setattr(torch, "__version__", version)
    strategy = Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="zbv_zero_bubble", stages_per_rank=2,
                                  num_microbatches=4)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)

    class ReachedProcessGroup(Exception):
        pass

    def sentinel(*args, **kwargs):
        raise ReachedProcessGroup

    monkeypatch.setattr("lightning_perf.strategies.base._init_dist_connection", sentinel)
    with pytest.raises(ValueError if refused else ReachedProcessGroup, match="zbv_zero_bubble.*needs NCCL"
                       if refused else None):
        strategy.setup_environment()
    assert not dist.is_initialized()
    check_schedule_backend("zbv_zero_bubble", 2, "nccl")  # NCCL runs it on every torch
    check_schedule_backend("zero_bubble", 2, "gloo")
    check_schedule_backend("zbv_zero_bubble", 1, "gloo")  # no pipeline: nothing to refuse
