"""RankWatchdog's flight recorder: the variables it sets before the process group (NCCL only, never
over the user's), the pack's strategies calling it, and the failed-collective error naming the dumps."""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_perf.callbacks import CollectiveTimeoutError, RankWatchdog
from lightning_perf.parallel.reliability.flight_recorder import FLIGHT_RECORDER_VARS
from lightning_perf.strategies import ZeroStrategy

NAMES = [n for names in FLIGHT_RECORDER_VARS.values() for n in names]


@pytest.fixture
def clean_env():
    saved = {n: os.environ.pop(n) for n in NAMES if n in os.environ}
    yield
    for n in NAMES:
        os.environ.pop(n, None)
    os.environ.update(saved)


def _trainer(tmp_path, callbacks=()):
    return SimpleNamespace(default_root_dir=str(tmp_path), global_rank=0, global_step=3, callbacks=list(callbacks))


def test_nccl_gets_the_recorder_in_the_run_directory(tmp_path, clean_env):
    wd = RankWatchdog(buffer_size=4000)
    wd.prepare_process_group(_trainer(tmp_path), "nccl")
    prefix = os.path.join(str(tmp_path), "flight_recorder", "nccl_trace_rank_")
    assert wd.dump_prefix == prefix and os.path.isdir(os.path.dirname(prefix))
    assert wd.flight_recorder_env == {
        "TORCH_FR_BUFFER_SIZE": "4000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "4000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    assert {n: os.environ[n] for n in NAMES} == wd.flight_recorder_env
    assert wd.set_before_process_group


def test_gloo_and_the_users_settings_are_left_alone(tmp_path, clean_env):
    wd = RankWatchdog()
    wd.prepare_process_group(_trainer(tmp_path), "gloo")
    assert wd.flight_recorder_env == {} and not set(NAMES) & set(os.environ)
    os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(tmp_path / "mine_")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "10"
    wd = RankWatchdog()
    wd.prepare_process_group(_trainer(tmp_path), "nccl")
    assert wd.dump_prefix == str(tmp_path / "mine_")
    assert wd.flight_recorder_env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "10" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    off = RankWatchdog(flight_recorder=False)
    off.prepare_process_group(_trainer(tmp_path), "nccl")
    assert off.dump_prefix is None and off.describe_dumps() == ""


def test_the_packs_strategy_calls_it_before_the_group(tmp_path, clean_env):
    wd = RankWatchdog(dump_dir=str(tmp_path / "fr"))
    strategy = ZeroStrategy(stage=1)
    strategy._lightning_module = SimpleNamespace(_trainer=_trainer(tmp_path, [wd]))
    strategy._prepare_process_group("nccl")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr" / "nccl_trace_rank_")


class _Diagnosed:
    """PeerWatchdog's verdict after a collective timed out with every rank alive."""

    def diagnose(self, exc):
        return CollectiveTimeoutError("rank 0: a collective timed out while every rank is alive (rank 0: step 3, "
                                      "rank 1: step 2)", {0: 3, 1: 2})

    def stop(self, done=True):
        pass


def test_a_timeout_names_the_dump_files_and_how_to_read_them(tmp_path, clean_env):
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        pytest.skip("this torch build's gloo does not record")
    wd = RankWatchdog()
    trainer = _trainer(tmp_path)
    wd.prepare_process_group(trainer, "gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        wd.watchdog = _Diagnosed()
        with pytest.raises(CollectiveTimeoutError) as caught:
            wd.on_exception(trainer, None, RuntimeError("Timed out waiting 1000ms for recv operation to complete"))
    finally:
        dist.destroy_process_group()
    dump = os.path.join(str(tmp_path), "flight_recorder", "nccl_trace_rank_0")
    message = str(caught.value)
    assert message.startswith("rank 0: a collective timed out while every rank is alive")
    assert f"(written: {dump})" in message
    assert (f"python -m torch.distributed.flight_recorder.fr_trace {os.path.dirname(dump)} --prefix nccl_trace_rank_"
            in message)
    assert caught.value.steps == {0: 3, 1: 2}
    assert "This rank's collective: gloo:all_reduce #" in message  # from its flight recorder
    assert pickle.load(open(dump, "rb"))["entries"][-1]["profiling_name"] == "gloo:all_reduce"


def test_exit_after_follows_the_strategys_timeout() -> None:
    from datetime import timedelta
    from types import SimpleNamespace

    from lightning_perf.callbacks import RankWatchdog

    def trainer(timeout):
        return SimpleNamespace(strategy=SimpleNamespace(_timeout=timeout))

    assert RankWatchdog()._exit_seconds(trainer(timedelta(seconds=60))) == 60.0
    assert RankWatchdog()._exit_seconds(SimpleNamespace(strategy=object())) == 1800.0  # torch's default
    assert RankWatchdog(exit_after=12)._exit_seconds(trainer(timedelta(seconds=60))) == 12.0
    assert RankWatchdog(exit_after=None)._exit_seconds(trainer(timedelta(seconds=60))) is None
    for bad in (-1, "soon", True):
        with pytest.raises(ValueError, match="exit_after"):
            RankWatchdog(exit_after=bad)


def test_pack_strategies_add_a_rank_watchdog_unless_the_fit_has_one() -> None:
    import lightning as L

    from lightning_perf.strategies import Parallel3DStrategy

    for strategy in (ZeroStrategy(stage=3), Parallel3DStrategy()):
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False)
        trainer.strategy._join_trainer(trainer)
        trainer.strategy._join_trainer(trainer)  # a second fit: still one
        added = [c for c in trainer.callbacks if isinstance(c, RankWatchdog)]
        assert len(added) == 1 and added[0].exit_after == "timeout"
    mine = RankWatchdog(dead_after=30, exit_after=None)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[mine])
    trainer.strategy._join_trainer(trainer)
    assert [c for c in trainer.callbacks if isinstance(c, RankWatchdog)] == [mine]


def test_under_nccl_the_exit_deadline_is_the_collective_timeout_in_the_recorder(tmp_path, clean_env, monkeypatch):
    from lightning_perf.callbacks import watchdog as callback_module

    monkeypatch.setattr(callback_module, "collective_deadline", lambda default_timeout_s=None: 1234.5)
    nccl = RankWatchdog()
    nccl.prepare_process_group(_trainer(tmp_path), "nccl")
    assert nccl._nccl_deadline() == 1234.5
    gloo = RankWatchdog()
    gloo.prepare_process_group(_trainer(tmp_path), "gloo")
    assert gloo._nccl_deadline() is None  # gloo raises its own timeout in Python: nothing to pre-empt
    off = RankWatchdog(flight_recorder=False)
    off.prepare_process_group(_trainer(tmp_path), "nccl")
    assert off._nccl_deadline() is None
    assert RankWatchdog(deadline_margin=0).deadline_margin == 0.0
    for bad in (-1, "soon", True):
        with pytest.raises(ValueError, match="deadline_margin"):
            RankWatchdog(deadline_margin=bad)


def test_before_exiting_the_rank_writes_its_dump_and_says_where(tmp_path, clean_env):
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        pytest.skip("this torch build's gloo does not record")
    wd = RankWatchdog()
    trainer = _trainer(tmp_path)
    wd.prepare_process_group(trainer, "gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        line = wd._before_exit(trainer)
    finally:
        dist.destroy_process_group()
    dump = os.path.join(str(tmp_path), "flight_recorder", "nccl_trace_rank_0")
    assert line.startswith("flight recorder: each rank's last collectives are dumped to "), line
    assert f"(written: {dump})" in line and "fr_trace" in line
    assert pickle.load(open(dump, "rb"))["entries"][-1]["profiling_name"] == "gloo:all_reduce"
