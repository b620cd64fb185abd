"""Bad ZeRO configurations fail at construction, before any process group exists."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_perf.parallel.layout import zero_config
from lightning_perf.plugins import PerfPrecision
from lightning_perf.strategies import STRATEGY_NAMES, ZeroStrategy, register_strategies


def test_unknown_stage() -> None:
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, got stage=4"):
        ZeroStrategy(stage=4)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stage": 2, "offload_params": True}, "offload_params needs stage 3"),
        ({"stage": 1, "backend": "native", "offload_optimizer": True}, "native CPU offload .* needs stage 2 or 3"),
        ({"stage": 3, "backend": "native", "offload_params": True}, "pass offload_optimizer=True with offload_params"),
        ({"stage": 3, "backend": "native", "offload_optimizer": True, "fp8_all_gather": True},
         "fp8_all_gather with native CPU offload"),
        ({"stage": 3, "replicate_size": 0}, "replicate_size must be a positive int or 'auto'"),
        ({"stage": 3, "replicate_size": "nodes"}, "replicate_size must be a positive int or 'auto'"),
        ({"stage": 1, "replicate_size": 2}, "replicate_size .* needs FSDP2: stage 2 or 3"),
        ({"stage": 1, "replicate_size": "auto"}, "replicate_size .* needs FSDP2: stage 2 or 3"),
        ({"stage": 3, "replicate_size": 2, "fp8_all_gather": True}, "fp8_all_gather with replicate_size"),
        ({"stage": 3, "gradient_compression": "fp16"}, "applies to the DDP all-reduce of stage 1"),
        ({"stage": 1, "gradient_compression": "int8"}, "is not one of"),
        ({"stage": 2, "reshard_after_forward": True}, "reshard_after_forward=True is ZeRO-3"),
        ({"stage": 3, "prefetch": -1}, "prefetch must be >= 0"),
        ({"stage": 1, "bucket_size_mb": 0}, "bucket_size_mb must be > 0"),
        ({"stage": 3, "init": "disk"}, "init='disk' is not one of"),
        ({"stage": 3, "backend": "megatron"}, "backend must be 'native' or 'deepspeed'"),
        ({"stage": 1, "fp8_all_gather": True}, "fp8_all_gather changes FSDP2's parameter all-gather"),
        ({"stage": 3, "blocks_per_unit": 0}, "blocks_per_unit must be an int >= 1"),
        ({"stage": 3, "blocks_per_unit": 1.5}, "blocks_per_unit must be an int >= 1"),
        ({"stage": 1, "blocks_per_unit": 2}, "blocks_per_unit groups FSDP2 units"),
        ({"stage": 3, "accumulation": "reduce_twice"}, "accumulation='reduce_twice' is not one of"),
    ],
)
def test_bad_options(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


@pytest.mark.parametrize("stage, refused, does", [(1, "reduce_each", "reduce_once"), (1, "gather_once", "reduce_once"),
                                                  (2, "reduce_once", "reduce_each"), (3, "gather_once", "reduce_each")])
def test_deepspeed_takes_only_its_own_accumulation(stage, refused, does) -> None:
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match=f"backend='deepspeed' at stage {stage} accumulates its own way "
                                         f"\\('{does}'.*pass accumulation='auto' or '{does}', or use backend='native'"):
        ZeroStrategy(stage=stage, backend="deepspeed", accumulation=refused)
    assert not dist.is_initialized()
    for ok in ("auto", does):
        assert ZeroStrategy(stage=stage, backend="deepspeed", accumulation=ok).config.accumulation == ok


def test_offload_without_deepspeed_names_the_extra(monkeypatch) -> None:
    monkeypatch.setattr(zero_config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-perf\[deepspeed\]'"):
        ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, backend="deepspeed")
    with pytest.raises(ImportError, match=r"lightning-perf\[deepspeed\]"):  # stage 1 offloads only there
        ZeroStrategy(stage=1, offload_optimizer=True)
    register_strategies()  # the registered offload names are native: no DeepSpeed needed
    trainer = L.Trainer(strategy="zero2_offload", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.config.native_offload and trainer.strategy.config.stage == 2


def test_offload_is_native_unless_deepspeed_is_named() -> None:
    register_strategies()
    for name, stage in (("zero2_offload", 2), ("zero3_offload", 3)):
        config = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False).strategy.config
        assert (config.backend, config.stage, config.native_offload) == ("native", stage, True)
    assert ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True).config.native_offload
    assert ZeroStrategy(stage=2, offload_optimizer=True).config.backend == "native"


def test_precision_the_backend_cannot_do() -> None:
    with pytest.raises(ValueError, match="does not support precision='16-true'"):
        L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=1, precision="16-true", logger=False)
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match="use 'bf16-mixed' instead of 'bf16-true'"):
        L.Trainer(strategy=ZeroStrategy(stage=2, backend="deepspeed"), accelerator="cpu", devices=1,
                  precision="bf16-true", logger=False)


def test_strategy_picks_perf_precision() -> None:
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=1, precision=precision,
                            logger=False)
        assert isinstance(trainer.precision_plugin, PerfPrecision)
        assert trainer.strategy.precision_plugin.precision == precision
    plugin = PerfPrecision("16-mixed", init_scale=8.0)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=1, plugins=[plugin], logger=False)
    assert trainer.strategy.precision_plugin is plugin


def test_registration_is_idempotent() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register_strategies()
    register_strategies()
    for name in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
        assert name in StrategyRegistry and name in STRATEGY_NAMES
    trainer = L.Trainer(strategy="zero2", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.stage == 2
    assert trainer.strategy.config.reshard_after_forward is False


def test_an_unknown_name_gets_lightnings_error_and_the_pack_names_are_registered() -> None:
    # docs/strategies.md quotes this error: Lightning lists none of the registered names in it
    from lightning.pytorch.strategies import StrategyRegistry

    register_strategies()
    assert set(STRATEGY_NAMES) == {"zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "parallel3d"}
    assert set(STRATEGY_NAMES) <= set(StrategyRegistry.available_strategies())
    with pytest.raises(ValueError, match=r"You selected an invalid strategy name: `strategy='zero4'`"):
        L.Trainer(strategy="zero4", accelerator="cpu", devices=1, logger=False)


def test_model_without_parameters_fails_before_any_collective() -> None:
    class Empty(L.LightningModule):
        def training_step(self, batch, batch_idx):
            return torch.zeros((), requires_grad=True)

        def configure_optimizers(self):
            return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    strategy = ZeroStrategy(stage=3)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    strategy._lightning_module = Empty()
    strategy.model = strategy._lightning_module
    with pytest.raises(ValueError, match=r"has no parameters \(0 elements\)"):
        strategy.setup(trainer)


def test_fp8_all_gather_without_fp8_linears_fails_before_any_collective() -> None:
    from lightning_perf.models.gpt.module import GPTLightningModule

    strategy = ZeroStrategy(stage=3, fp8_all_gather=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    module = GPTLightningModule("tiny")  # fp8 off: no Float8Linear
    module.configure_model()
    strategy._lightning_module = module
    strategy.model = module
    with pytest.raises(ValueError, match="no FP8 linear layers"):
        strategy.setup(trainer)  # no process group exists: the check runs before any collective


def test_hsdp_mesh_shape_and_its_arithmetic() -> None:
    cfg = zero_config.ZeroConfig(stage=3, replicate_size=2)
    assert cfg.mesh_shape(8) == (2, 4) and cfg.mesh_shape(2) == (2, 1)
    auto = zero_config.ZeroConfig(stage=2, replicate_size="auto")
    assert auto.mesh_shape(16, num_nodes=2) == (2, 8) and auto.mesh_shape(4, num_nodes=1) == (1, 4)
    assert zero_config.ZeroConfig(stage=3).mesh_shape(6, num_nodes=3) == (1, 6)  # replication is opt-in
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by replicate_size 4: 6 / 4 = 1.5"):
        zero_config.ZeroConfig(stage=3, replicate_size=4).mesh_shape(6)
    with pytest.raises(ValueError, match=r"replicate_size='auto' = num_nodes \(4\)"):
        auto.mesh_shape(6, num_nodes=4)


def test_hsdp_layout_fails_when_the_trainer_is_built() -> None:
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by replicate_size 2"):
        L.Trainer(strategy=ZeroStrategy(stage=3, replicate_size=2), accelerator="cpu", devices=3, logger=False)
    assert not dist.is_initialized()


def test_native_offload_options() -> None:
    strategy = ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, backend="native")
    assert strategy.config.native_offload and strategy.config.uses_fsdp
    assert ZeroStrategy(stage=2, offload_optimizer=True, backend="native").config.native_offload
    assert not ZeroStrategy(stage=3).config.native_offload


def test_bf16_gradient_compression_is_refused_on_the_cpu() -> None:
    """torch's bf16 all-reduce hook needs NCCL: on the CPU (gloo) it failed in the first backward."""
    config = zero_config.ZeroConfig(stage=1, gradient_compression="bf16")
    with pytest.raises(ValueError, match="gradient_compression='bf16' .* needs CUDA and NCCL"):
        config.check_precision("32-true", "cpu")
    config.check_precision("32-true", "cuda")
    zero_config.ZeroConfig(stage=1, gradient_compression="fp16").check_precision("32-true", "cpu")
