"""Bad input raises in the launching process, once, before any child process or process group starts.

``Trainer(devices=2).fit`` and ``lightning-perf fit`` go through Lightning's subprocess launcher; the
pack's strategies check the model, its layout and the data module before that launcher starts the
other ranks. Here the child-spawn function and the process-group start are replaced by recorders:
a bad input must raise before either runs, a good one must reach both. A launcher that is None (an
already-launched torchrun) still gets the same checks in each process, before its process group.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.strategies.launchers import subprocess_script

from lightning_perf.data import TokenDataModule
from lightning_perf.models.gpt import GPTConfig
from lightning_perf.models.gpt.module import GPTLightningModule
from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy


class ReachedProcessGroup(Exception):
    """Raised in place of creating the process group: every check before it passed."""


@pytest.fixture
def spawned(monkeypatch) -> list[Any]:
    """The launchers whose child-spawn function ran; no child starts and no process group is created."""
    calls: list[Any] = []
    launcher = subprocess_script._SubprocessScriptLauncher
    monkeypatch.setattr(launcher, "_call_children_scripts", lambda self: calls.append(self))
    monkeypatch.setattr(subprocess_script, "_launch_process_observer", lambda procs: None)
    monkeypatch.setattr(subprocess_script, "_set_num_threads_if_needed", lambda num_processes: None)

    def sentinel(*args: Any, **kwargs: Any) -> None:
        raise ReachedProcessGroup

    monkeypatch.setattr("lightning_perf.strategies.base._init_dist_connection", sentinel)
    yield calls
    assert not (dist.is_available() and dist.is_initialized()), "a process group was created"


def _trainer(strategy: Any, tmp_path, devices: int = 2) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path)


class PlainNet(L.LightningModule):
    """A user's module, its network built in ``__init__``, without the 3D model protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=2)


class LaterNet(PlainNet):
    """The same network, built in ``configure_model``: its protocol is checked in ``setup``."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


class EmptyNet(PlainNet):
    def __init__(self) -> None:
        L.LightningModule.__init__(self)


def _gpt(preset: str = "tiny-llama", **overrides: Any) -> GPTLightningModule:
    return GPTLightningModule(GPTConfig.from_name(preset, **overrides))


BAD_3D = [
    pytest.param(dict(tensor_parallel_size=2), lambda: _gpt(n_head=3, n_kv_head=3, n_embd=96),
                 r"^n_head \(3\) is not divisible by tensor_parallel_size \(2\): 3 / 2 = 1\.5; each tensor-parallel "
                 r"rank needs whole heads$", id="tp-heads"),
    pytest.param(dict(tensor_parallel_size=2), PlainNet,
                 r"^tensor parallelism \(tp=2\) needs the model to implement `tensor_parallel_plan\(self, tp_mesh\) "
                 r"-> dict .*`; no submodule of PlainNet defines `tensor_parallel_plan`\. Implement it \(the 3D "
                 r"model protocol: help\(lightning_perf\.strategies\.Parallel3DStrategy\)\)", id="tp-no-protocol"),
    pytest.param(dict(pipeline_parallel_size=2), PlainNet,
                 r"^pipeline parallelism \(pp=2\) needs the model to implement `pipeline_stage", id="pp-no-protocol"),
    pytest.param(dict(data_parallel_size=2, fp8_all_gather=True), _gpt,
                 r"^fp8_all_gather=True, but GPTLightningModule's GPTConfig has fp8=False", id="fp8-gather"),
]


@pytest.mark.parametrize("options, module, match", BAD_3D)
def test_parallel3d_bad_model_raises_in_the_parent(options, module, match, spawned, tmp_path) -> None:
    trainer = _trainer(Parallel3DStrategy(**options), tmp_path)
    with pytest.raises(ValueError, match=match) as raised:
        trainer.fit(module())
    assert spawned == [], "the launcher started the other ranks before the check"
    assert "examples/" not in str(raised.value)


def test_parallel3d_bad_data_raises_in_the_parent(spawned, tmp_path) -> None:
    data = TokenDataModule(source="synthetic", vocab_size=260, seq_len=15, batch_size=4)
    trainer = _trainer(Parallel3DStrategy(tensor_parallel_size=2), tmp_path)
    with pytest.raises(ValueError, match=r"sequence parallelism splits seq_len=15 over tp=2 ranks"):
        trainer.fit(_gpt(), datamodule=data)
    assert spawned == []


def test_parallel3d_tied_head_on_one_sharded_rank_raises_in_the_parent(spawned, tmp_path) -> None:
    # V placement runs the first and last stage (embedding and tied head) on one rank; ZeRO over dp2
    strategy = Parallel3DStrategy(pipeline_parallel_size=2, pipeline_schedule="zbv_zero_bubble", stages_per_rank=2,
                                  num_microbatches=4, zero_stage=2)
    with pytest.raises(ValueError, match=r"^pipeline_schedule='zbv_zero_bubble' runs the first and the last stage "
                                         r"on one rank, where a tied LM head .* use zero_stage=0"):
        _trainer(strategy, tmp_path, devices=4).fit(GPTLightningModule("tiny"))
    assert spawned == []


@pytest.mark.parametrize("options, module", [
    (dict(tensor_parallel_size=2), _gpt),
    (dict(pipeline_parallel_size=2), lambda: GPTLightningModule("tiny", config_overrides={"tie_embeddings": False})),
    (dict(pipeline_parallel_size=2), lambda: GPTLightningModule("tiny")),  # tied: copies on the two stages
    (dict(pipeline_parallel_size=2, pipeline_schedule="zbv_zero_bubble", stages_per_rank=2, num_microbatches=4),
     lambda: GPTLightningModule("tiny")),  # tied on one rank, dp1: one parameter
    (dict(data_parallel_size=2), PlainNet),
    (dict(tensor_parallel_size=2), LaterNet),  # the network comes in configure_model: checked in setup
], ids=["tp2-gpt", "pp2-untied-gpt", "pp2-tied-gpt", "pp2-zbv-tied-gpt", "dp2-plain", "tp2-configure-model"])
def test_parallel3d_good_layout_passes_the_check(options, module, spawned, tmp_path) -> None:
    trainer = _trainer(Parallel3DStrategy(**options), tmp_path)
    from lightning_perf.parallel.model_parallel.pipeline import zbv_runs_on_gloo

    if options.get("pipeline_schedule") == "zbv_zero_bubble" and not zbv_runs_on_gloo():
        with pytest.raises(ValueError, match="zbv_zero_bubble.*needs NCCL"):  # gloo: refused before its group
            trainer.fit(module(), datamodule=TokenDataModule(source="synthetic", vocab_size=260, seq_len=16,
                                                             batch_size=4))
        return
    with pytest.raises(ReachedProcessGroup):
        trainer.fit(module(), datamodule=TokenDataModule(source="synthetic", vocab_size=260, seq_len=16, batch_size=4))
    assert len(spawned) == 1 and spawned[0] is trainer.strategy.launcher


@pytest.mark.parametrize("options, module, match", [
    (dict(stage=3), EmptyNet, r"^EmptyNet has no parameters \(0 elements\)"),
    (dict(stage=2, fp8_all_gather=True), _gpt,
     r"^fp8_all_gather=True, but GPTLightningModule's GPTConfig has fp8=False"),
    (dict(stage=2, fp8_all_gather=True), PlainNet, r"^fp8_all_gather=True, but PlainNet has no FP8 linear layers"),
], ids=["no-parameters", "fp8-gather-gpt", "fp8-gather-plain"])
def test_zero_bad_model_raises_in_the_parent(options, module, match, spawned, tmp_path) -> None:
    trainer = _trainer(ZeroStrategy(**options), tmp_path)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module())
    assert spawned == []


def test_zero_bad_data_raises_in_the_parent(spawned, tmp_path) -> None:
    data = TokenDataModule(source="synthetic", vocab_size=260, seq_len=512, batch_size=2)
    trainer = _trainer(ZeroStrategy(stage=3), tmp_path)
    with pytest.raises(ValueError, match=r"^seq_len=512 is longer than the model's block_size=256"):
        trainer.fit(_gpt(), data)  # a data module passed in place of the train loaders is found too
    assert spawned == []


@pytest.mark.parametrize("module", [_gpt, PlainNet, LaterNet])
def test_zero_good_model_passes_the_check(module, spawned, tmp_path) -> None:
    trainer = _trainer(ZeroStrategy(stage=3), tmp_path)
    with pytest.raises(ReachedProcessGroup):
        trainer.fit(module())
    assert len(spawned) == 1


def test_without_a_launcher_each_process_checks_before_its_process_group(spawned, monkeypatch, tmp_path) -> None:
    # torchrun started this process: no process is started (the strategy's in-place launcher only prepares
    # the resume), the strategy checks in-process
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29599")
    trainer = _trainer(Parallel3DStrategy(tensor_parallel_size=2), tmp_path)
    assert not isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    with pytest.raises(ValueError, match=r"n_head \(3\) is not divisible by tensor_parallel_size \(2\)"):
        trainer.fit(_gpt(n_head=3, n_kv_head=3, n_embd=96))
    ok = _trainer(Parallel3DStrategy(tensor_parallel_size=2), tmp_path)
    with pytest.raises(ReachedProcessGroup):
        ok.fit(_gpt())
    assert spawned == []


def _cli(tmp_path, monkeypatch, *flags: str, debug: bool = True) -> None:
    from lightning_perf.cli import DEBUG_ENV, main

    monkeypatch.chdir(tmp_path)
    # with the traceback asked for, the command raises the error itself (else: a short message, exit 1)
    monkeypatch.setenv(DEBUG_ENV, "1" if debug else "")
    main(["fit", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false",
          "--trainer.callbacks=[]", "--trainer.max_steps=1", "--data.source=synthetic", "--data.vocab_size=260",
          "--data.seq_len=16", "--data.batch_size=4", *flags])


def test_cli_bad_layout_raises_in_the_parent(spawned, monkeypatch, tmp_path, capsys) -> None:
    layout = ("--model.config=tiny", "--trainer.strategy=lightning_perf.strategies.Parallel3DStrategy",
              "--trainer.strategy.pipeline_parallel_size=2", "--trainer.strategy.pipeline_schedule=interleaved_1f1b",
              "--trainer.strategy.stages_per_rank=3", "--trainer.strategy.num_microbatches=6")
    with pytest.raises(ValueError, match=r"^n_layer \(4\) is not divisible by pipeline stages"):
        _cli(tmp_path, monkeypatch, *layout)
    capsys.readouterr()
    with pytest.raises(SystemExit) as short:  # as a user sees it
        _cli(tmp_path, monkeypatch, *layout, debug=False)
    assert short.value.code == 1
    assert "lightning-perf fit: error: n_layer (4) is not divisible by pipeline stages" in capsys.readouterr().err
    assert spawned == []


def test_cli_good_layout_passes_the_check(spawned, monkeypatch, tmp_path) -> None:
    with pytest.raises(ReachedProcessGroup):
        _cli(tmp_path, monkeypatch, "--model.config=tiny-llama",
             "--trainer.strategy=lightning_perf.strategies.Parallel3DStrategy",
             "--trainer.strategy.tensor_parallel_size=2")
    assert len(spawned) == 1


# ---- delayed FP8 scaling needs plain weights ----------------------------------------------------

_DELAYED = r"^fp8='delayed' keeps an amax history in each FP8 linear for plain weights, but "


class DelayedNet(PlainNet):
    """A user's network whose linears were converted to delayed FP8 in ``__init__``."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from lightning_perf.kernels.torchao_fp8 import convert_to_fp8

        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        assert convert_to_fp8(self.model, "delayed") == ["0", "2"]


def _delayed_gpt() -> GPTLightningModule:
    return _gpt(fp8="delayed")


@pytest.mark.parametrize("strategy, module, match", [
    (lambda: Parallel3DStrategy(tensor_parallel_size=2), _delayed_gpt, _DELAYED + r"tensor_parallel_size=2 makes "
     r"GPTLightningModule's weights DTensors: use fp8='tensorwise'"),
    (lambda: Parallel3DStrategy(data_parallel_size=2, zero_stage=2), _delayed_gpt,
     _DELAYED + r"zero_stage=2 over dp\(2\) \* cp\(1\) = 2 ranks \(FSDP2\) makes"),
    (lambda: Parallel3DStrategy(context_parallel_size=2, zero_stage=3), _delayed_gpt,
     _DELAYED + r"zero_stage=3 over dp\(1\) \* cp\(2\) = 2 ranks \(FSDP2\) makes"),
    (lambda: ZeroStrategy(stage=3), _delayed_gpt, _DELAYED + r"ZeroStrategy\(stage=3\) sharding them with FSDP2"),
    (lambda: ZeroStrategy(stage=2), DelayedNet, _DELAYED + r"ZeroStrategy\(stage=2\) .* makes DelayedNet's weights"),
], ids=["3d-tp2", "3d-fsdp-dp2", "3d-fsdp-cp2", "zero3-gpt", "zero2-layers"])
def test_delayed_fp8_with_dtensor_weights_raises_in_the_parent(strategy, module, match, spawned, tmp_path) -> None:
    trainer = _trainer(strategy(), tmp_path)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module())
    assert spawned == []


@pytest.mark.parametrize("strategy, module", [
    (lambda: ZeroStrategy(stage=1), _delayed_gpt),  # DDP: every rank holds plain weights
    (lambda: Parallel3DStrategy(data_parallel_size=2, zero_stage=0), _delayed_gpt),
    (lambda: Parallel3DStrategy(pipeline_parallel_size=2, zero_stage=0), lambda: GPTLightningModule(
        GPTConfig.from_name("tiny", fp8="delayed"))),
    (lambda: ZeroStrategy(stage=3), lambda: _gpt(fp8="tensorwise")),
], ids=["zero1", "3d-dp2-replicated", "3d-pp2", "zero3-tensorwise"])
def test_delayed_fp8_with_plain_weights_passes_the_check(strategy, module, spawned, tmp_path) -> None:
    trainer = _trainer(strategy(), tmp_path)
    with pytest.raises(ReachedProcessGroup):
        trainer.fit(module(), datamodule=TokenDataModule(source="synthetic", vocab_size=260, seq_len=16, batch_size=4))
    assert len(spawned) == 1
