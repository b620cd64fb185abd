"""What the pack's strategies share through ``PerfParallelStrategy``.

- one precision rule: ``Trainer(precision=...)`` and Lightning's plugins become ``PerfPrecision``,
  a user's ``PerfPrecision`` is kept, anything else fails at construction naming the choices;
- one checkpoint layout: a checkpoint saved by ``ZeroStrategy(stage=3)`` on 2 gloo ranks loads
  into ``Parallel3DStrategy`` (dp2) and the other way round, parameters and optimizer state
  equal; checkpoints that nest Lightning's dict under ``"lightning"`` load in both;
- one ``remove_checkpoint``: a sharded directory as a whole, a file, a link;
- one source of options: each strategy's config dataclass is built from its constructor's arguments,
  the fields being parameters of the same names and defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _spawn import spawn
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

from lightning_perf.parallel.layout.config_3d import Parallel3DConfig
from lightning_perf.parallel.layout.zero_config import ZeroConfig
from lightning_perf.plugins import PerfPrecision
from lightning_perf.strategies import Parallel3DStrategy, PerfParallelStrategy, ZeroStrategy
from lightning_perf.strategies.base import _lightning_checkpoint, config_from_arguments

B, T, STEPS, VOCAB = 2, 16, 3, 100  # per-rank batch, sequence, steps before the save

STRATEGIES = {"zero3": lambda **kw: ZeroStrategy(stage=3, **kw), "parallel3d": lambda **kw: Parallel3DStrategy(**kw)}


def _trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, **kwargs)


# ---- precision ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_precision_becomes_perf_precision(name: str, precision: str) -> None:
    strategy = STRATEGIES[name]()
    _trainer(strategy, precision=precision)
    assert type(strategy.precision_plugin) is PerfPrecision
    assert strategy.precision_plugin.precision == precision


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_users_perf_precision_is_kept(name: str) -> None:
    plugin = PerfPrecision("16-mixed", init_scale=8.0)
    strategy = STRATEGIES[name]()
    _trainer(strategy, plugins=[plugin])
    assert strategy.precision_plugin is plugin
    assert STRATEGIES[name](precision_plugin=plugin).precision_plugin is plugin


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("plugin", [MixedPrecision("16-mixed", "cpu"), MixedPrecision("bf16-mixed", "cpu"),
                                    HalfPrecision("bf16-true")], ids=lambda p: p.precision)
def test_lightning_plugins_of_a_supported_precision_are_converted(name: str, plugin: Any) -> None:
    strategy = STRATEGIES[name]()
    _trainer(strategy, plugins=[plugin])
    assert type(strategy.precision_plugin) is PerfPrecision
    assert strategy.precision_plugin.precision == plugin.precision


@pytest.mark.parametrize("name", STRATEGIES)
def test_unsupported_precision_names_the_choices(name: str) -> None:
    choices = r"the supported precisions are 32-true, bf16-mixed, 16-mixed, bf16-true"
    for precision in ("16-true", "64-true"):
        with pytest.raises(ValueError, match=rf"does not support precision='{precision}'.*{choices}"):
            _trainer(STRATEGIES[name](), precision=precision)
    with pytest.raises(ValueError, match=rf"{STRATEGIES[name]().__class__.__name__} does not support .*{choices}"):
        STRATEGIES[name](precision_plugin=DoublePrecision())
    assert not dist.is_initialized()


def test_each_strategy_keeps_its_own_precision_checks() -> None:
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match="use 'bf16-mixed' instead of 'bf16-true'"):
        ZeroStrategy(stage=2, backend="deepspeed", precision_plugin=PerfPrecision("bf16-true"))
    assert Parallel3DStrategy(precision_plugin=PerfPrecision("bf16-true")).precision_plugin.precision == "bf16-true"


def test_both_strategies_share_one_base() -> None:
    for cls in (ZeroStrategy, Parallel3DStrategy):
        assert cls.__mro__[1] is PerfParallelStrategy
    for name in ("barrier", "broadcast", "reduce", "teardown", "save_checkpoint", "load_checkpoint",
                 "remove_checkpoint", "setup_environment", "_configure_launcher", "precision_plugin"):
        assert name not in vars(ZeroStrategy) and name not in vars(Parallel3DStrategy), name


# ---- options: one dataclass, built from the constructor's own arguments --------------------------

OPTIONS = [(ZeroStrategy, ZeroConfig, {"stage": 2, "prefetch": 2, "blocks_per_unit": 2, "deepspeed_config": {"a": 1}}),
           (Parallel3DStrategy, Parallel3DConfig, {"zero_stage": 3, "pipeline_schedule": "gpipe", "tp_overlap": "none",
                                                   "activation_checkpointing": "selective", "compile": "default"})]


@pytest.mark.parametrize(("strategy_cls", "config_cls", "given"), OPTIONS, ids=lambda x: getattr(x, "__name__", ""))
def test_options_are_the_constructors_arguments(strategy_cls: type, config_cls: type, given: dict) -> None:
    params = inspect.signature(strategy_cls.__init__).parameters
    base = inspect.signature(PerfParallelStrategy.__init__).parameters
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    for name, f in fields.items():  # every option is a typed parameter (LightningCLI), with the same default
        assert name in params, name
        assert params[name].annotation is not inspect.Parameter.empty, name
        assert params[name].default == f.default, name
    # and every parameter is an option, Lightning's, or the base's
    own = set(params) - set(fields) - set(base) - {"self", "kwargs"}
    assert own <= {"meta_init"}, own
    strategy = strategy_cls(**given)
    assert isinstance(strategy.config, config_cls)
    assert {k: getattr(strategy.config, k) for k in given} == given
    assert strategy.config == config_cls(**given)  # nothing else changed on the way
    with pytest.raises(TypeError, match=r"fields \['stage'\] are not arguments"):
        config_from_arguments(ZeroConfig, {n: getattr(ZeroConfig(), n) for n in dataclasses.asdict(ZeroConfig())
                                           if n != "stage"})


def test_strategies_state_their_settings() -> None:
    zero = ZeroStrategy(stage=2, blocks_per_unit=2)
    _trainer(zero, precision="bf16-mixed")
    s = zero.perf_settings()
    assert (s.precision, s.zero_stage, s.tensor_parallel_size, s.fsdp_blocks_per_unit) == ("bf16-mixed", 2, 1, 2)
    assert ZeroStrategy(stage=1).perf_settings().fsdp_blocks_per_unit is None  # DDP: no FSDP2 units
    three = Parallel3DStrategy(zero_stage=3, activation_checkpointing="full", compile="default", fsdp_blocks_per_unit=2)
    assert three.perf_settings().fsdp_blocks_per_unit is None  # no processes yet: nothing known to shard
    L.Trainer(strategy=three, accelerator="cpu", devices=2, logger=False)  # dp2: FSDP2 shards (nothing launched)
    s = three.perf_settings()
    assert (s.zero_stage, s.pipeline_parallel_size, s.fsdp_blocks_per_unit) == (3, 1, 2)
    assert (s.compile_mode, s.compile_scope, s.activation_checkpointing) == ("default", "block", "full")
    for alone in (Parallel3DStrategy(zero_stage=0), Parallel3DStrategy(pipeline_parallel_size=2, num_microbatches=2)):
        L.Trainer(strategy=alone, accelerator="cpu", devices=2, logger=False)  # no dp: nothing for FSDP2 to shard
        assert alone.perf_settings().fsdp_blocks_per_unit is None


# ---- remove_checkpoint and the layout ------------------------------------------------------------


def test_remove_checkpoint_takes_a_directory_a_file_and_a_link(tmp_path: Path) -> None:
    strategy = ZeroStrategy(stage=3)  # no process group: global rank 0
    sharded = tmp_path / "step=4.ckpt"
    sharded.mkdir()
    (sharded / "__0_0.distcp").write_bytes(b"0")
    (sharded / "extra.pt").write_bytes(b"0")
    plain = tmp_path / "plain.ckpt"
    plain.write_bytes(b"0")
    kept = tmp_path / "kept.ckpt"
    kept.mkdir()
    link = tmp_path / "last.ckpt"
    link.symlink_to(kept)
    for path in (sharded, plain, link, tmp_path / "missing.ckpt"):
        strategy.remove_checkpoint(path)
        assert not path.exists() and not path.is_symlink(), path
    assert kept.is_dir()  # a link goes, not what it points at


def test_lightning_dict_is_read_from_either_layout() -> None:
    state = {"global_step": 3, "loops": {}, "epoch": 0}
    assert _lightning_checkpoint(state) == state
    assert _lightning_checkpoint({"lightning": state}) == state


# ---- a checkpoint of one strategy loads into the other (2 gloo ranks) ---------------------------


def _module():
    from lightning_perf.models.gpt import GPTConfig
    from lightning_perf.models.gpt.module import GPTLightningModule

    config = GPTConfig(name="t", vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32,
                       pad_vocab_multiple=16, bias=False)

    class Recording(GPTLightningModule):
        def __init__(self) -> None:
            super().__init__(config, learning_rate=1e-3, warmup_steps=0, min_lr_ratio=1.0)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float().item())
            return loss

    return Recording()


def _fit(strategy: Any, *, ckpt_path: Optional[Path] = None, save_to: Optional[Path] = None) -> dict:
    """Train ``STEPS`` steps, or only load ``ckpt_path`` (saved at ``STEPS``: nothing left to train)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict

    L.seed_everything(0, verbose=False)
    module = _module()
    data = torch.randint(0, VOCAB, (4 * STEPS * B, T + 1), generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=B)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {"losses": module.losses, "final": full_model_state_dict(module), "step": trainer.global_step}


def _nest_lightning_dict(src: Path, dst: Path) -> None:
    """A copy of checkpoint ``src`` whose Lightning dict sits under ``extra["lightning"]``."""
    from lightning_perf.parallel.checkpointing.checkpoint import EXTRA_FILE, read_extra

    shutil.copytree(src, dst)
    blob = read_extra(src)
    blob["extra"] = {"lightning": blob["extra"]}
    torch.save(blob, dst / EXTRA_FILE)  # the manifest lists the shard files only


def _worker(rank: int, world: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    zero = lambda: ZeroStrategy(stage=3)  # noqa: E731
    dp2 = lambda: Parallel3DStrategy(data_parallel_size=2)  # noqa: E731
    res["zero"] = _fit(zero(), save_to=out / "zero.ckpt")
    res["zero_in_3d"] = _fit(dp2(), ckpt_path=out / "zero.ckpt", save_to=out / "zero_in_3d.ckpt")
    res["3d"] = _fit(dp2(), save_to=out / "3d.ckpt")
    res["3d_in_zero"] = _fit(zero(), ckpt_path=out / "3d.ckpt", save_to=out / "3d_in_zero.ckpt")
    if rank == 0:
        _nest_lightning_dict(out / "zero.ckpt", out / "nested.ckpt")
    dist.barrier()  # the process group of the fits above is still up
    res["nested_in_zero"] = _fit(zero(), ckpt_path=out / "nested.ckpt")
    res["nested_in_3d"] = _fit(dp2(), ckpt_path=out / "nested.ckpt")
    return res


def _read_shards(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    assert len(state) == len(metadata.state_dict_metadata), "only tensors are saved"
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m: f"{what} {k}: {m}")


@pytest.mark.slow
def test_checkpoints_load_across_strategies(tmp_path: Path) -> None:
    from lightning_perf.parallel.checkpointing.checkpoint import read_extra

    results = spawn(_worker, 2, tmp_path, timeout=300.0)
    for saved, loaded in (("zero", "zero_in_3d"), ("3d", "3d_in_zero")):
        # the same files: model shards, optimizer state, optimizer hyper-parameters, Lightning's dict
        shards = _read_shards(tmp_path / f"{saved}.ckpt")
        assert any(k.startswith("optim.state.") for k in shards) and any(k.startswith("model.") for k in shards)
        _equal(shards, _read_shards(tmp_path / f"{loaded}.ckpt"), f"{saved} -> {loaded}")
        blob, blob_loaded = read_extra(tmp_path / f"{saved}.ckpt"), read_extra(tmp_path / f"{loaded}.ckpt")
        assert blob["param_groups"] == blob_loaded["param_groups"]
        assert blob["extra"]["global_step"] == blob_loaded["extra"]["global_step"] == STEPS  # flat layout
        for r in results:  # the loading strategy holds the saved parameters and resumed at the saved step
            assert len(r[saved]["losses"]) == STEPS and r[loaded]["losses"] == []
            assert r[loaded]["step"] == STEPS
            _equal(r[saved]["final"], r[loaded]["final"], f"{saved} -> {loaded} parameters")
    for loaded in ("nested_in_zero", "nested_in_3d"):
        for r in results:
            assert r[loaded]["step"] == STEPS and r[loaded]["losses"] == []
            _equal(r["zero"]["final"], r[loaded]["final"], loaded)


# ---- async_checkpoint: on by default on CUDA devices -----------------------------


@pytest.mark.parametrize("cls", ["ZeroStrategy", "Parallel3DStrategy"])
def test_async_checkpoint_defaults_to_cuda_devices(cls: str) -> None:
    import lightning_perf.strategies as strategies

    strategy_cls = getattr(strategies, cls)
    assert strategy_cls(parallel_devices=[torch.device("cpu")] * 2).async_checkpoint is False
    assert strategy_cls(parallel_devices=[torch.device("cuda", 0)]).async_checkpoint is True
    if cls == "ZeroStrategy":  # DeepSpeed's engine writes its checkpoint in the save call
        assert strategy_cls(backend="deepspeed", parallel_devices=[torch.device("cuda", 0)]).async_checkpoint is False
    assert strategy_cls(parallel_devices=[torch.device("cuda", 0)], async_checkpoint=True).async_checkpoint is True
    assert strategy_cls(parallel_devices=[torch.device("cuda", 0)], async_checkpoint=False).async_checkpoint is False
    assert strategy_cls(parallel_devices=[torch.device("cpu")], async_checkpoint=True).async_checkpoint is True
