"""CommOverlapMonitor on 2 forked gloo ranks: DDP's gradient all-reduce found, sized and split."""

from __future__ import annotations

import json
import os

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy

from callback_toys import D, H, V, ToyLM, loader, trainer
from lightning_perf.callbacks import CommOverlapMonitor


class Dump(Callback):
    def __init__(self, mon: CommOverlapMonitor, out_dir: str) -> None:
        self.mon, self.out_dir = mon, out_dir

    def on_train_end(self, trainer, pl_module):
        with open(os.path.join(self.out_dir, f"comm{trainer.global_rank}.json"), "w") as f:
            json.dump({"results": self.mon.results, "summary": self.mon.summary()}, f)


@pytest.mark.slow
def test_ddp_allreduce_is_measured(tmp_path):
    mon = CommOverlapMonitor(start_step=1, every_n_steps=0)
    strategy = DDPStrategy(process_group_backend="gloo", start_method="fork")
    trainer(tmp_path, [mon, Dump(mon, str(tmp_path))], max_steps=3, devices=2, strategy=strategy).fit(
        ToyLM(), loader(n=16))
    param_bytes = 4 * (V * D + D * H + H * V)
    for rank in range(2):
        with open(tmp_path / f"comm{rank}.json") as f:
            data = json.load(f)
        (result,) = data["results"]
        assert result["step"] == 1
        assert result["comm_s"] > 0
        assert 0 <= result["exposed_s"] <= result["comm_s"] + 1e-12
        assert result["exposed_s"] + result["overlapped_s"] == pytest.approx(result["comm_s"])
        assert 0 <= result["exposed_fraction"] <= 1
        allreduce = result["collectives"]["all_reduce"]
        # DDP reduces every gradient once per step (in one or more buckets); Lightning adds none here
        assert allreduce["bytes"] == param_bytes
        assert allreduce["busbw"] == pytest.approx(allreduce["algbw"] * 2 * (2 - 1) / 2)
