"""``AsyncCheckpointer``: background saves equal synchronous ones, and a failed one changes nothing.

Two gloo ranks, a two-layer model under FSDP2 (DTensor shards) and AdamW:

- a save started at step 1 whose finalization is held back while the ranks take two more
  steps holds step 1's parameters and optimizer state, byte for byte the synchronous save of
  the same step (so the shards were copied before the next optimizer step); it is not visible
  (no directory, only ``.tmp``) until finalized; its manifest verifies;
- a removal asked for while a save is in flight runs only once that save is final;
- a writer that fails on one rank fails the save on both: the error names the checkpoint, the
  ``.tmp`` is never renamed, the checkpoint it would have replaced still loads with its old
  contents, and the removal deferred behind it never runs.

And in one process without a process group: the same equality with the synchronous save.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from _spawn import spawn


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _step(model, opt, seed: int) -> None:
    torch.manual_seed(100 + seed)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _read_shards(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _worker(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_perf.parallel.checkpointing import checkpoint as ckpt
    from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointer, AsyncCheckpointError

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    res: dict = {}

    ckpt.save_checkpoint(out / "sync1", model, [opt], extra={"step": 1})
    ckpt.save_checkpoint(out / "old", model, [opt], extra={"step": 1})  # to be removed once async1 is final

    gate, real_finish = threading.Event(), ckpt.finish_save

    def held_finish(*args, **kwargs):
        assert gate.wait(60)
        return real_finish(*args, **kwargs)

    ckpt.finish_save = held_finish
    saver = AsyncCheckpointer()
    saver.save(out / "async1", model, [opt], extra={"step": 1})
    _step(model, opt, 1)  # training goes on while the save is in flight
    _step(model, opt, 2)
    saver.remove(out / "old")
    dist.barrier()
    res["in_flight"] = dict(polled=saver.poll(), pending=saver.pending, visible=(out / "async1").exists(),
                            tmp=(out / "async1.tmp").is_dir(), old_kept=(out / "old").is_dir())
    dist.barrier()
    gate.set()
    ckpt.finish_save = real_finish
    res["finalized"] = saver.wait()
    dist.barrier()
    res["old_after"] = (out / "old").exists()
    blob = ckpt.read_extra(out / "async1")
    ckpt.verify_files(out / "async1", blob["files"])  # raises on a mismatch
    res["extra"] = blob["extra"]

    # a failing writer on rank 1: the save in flight over "async1" fails on both ranks
    ckpt.save_checkpoint(out / "old2", model, [opt])
    real_write = FileSystemWriter.write_data

    def failing_write(self, *args, **kwargs):
        raise OSError("no space left on device")

    if rank == 1:
        FileSystemWriter.write_data = failing_write
    saver.save(out / "async1", model, [opt], extra={"step": 3})
    saver.remove(out / "old2")
    try:
        saver.wait()
        res["error"] = None
    except AsyncCheckpointError as e:
        res["error"] = str(e)
    FileSystemWriter.write_data = real_write
    dist.barrier()
    res["after_failure"] = dict(tmp=(out / "async1.tmp").is_dir(), extra=ckpt.read_extra(out / "async1")["extra"],
                                old2_kept=(out / "old2").is_dir(), pending=saver.pending)
    # the intact checkpoint still loads (manifest verified) into a fresh sharded model
    fresh = _model()
    for layer in fresh:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    res["loaded_extra"] = ckpt.load_checkpoint(out / "async1", fresh, [fresh_opt])
    res["loaded"] = ckpt.full_model_state_dict(fresh)
    saver.close()
    return res


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("async")
    return out, spawn(_worker, 2, out, timeout=120.0, init_group=True)


def test_async_save_equals_sync_save_of_the_same_step(two_ranks) -> None:
    out, results = two_ranks
    sync, async_ = _read_shards(out / "sync1"), _read_shards(out / "async1")
    assert sync.keys() == async_.keys()
    assert any(k.startswith("optim.") for k in sync) and any(k.startswith("model.") for k in sync)
    for k in sync:  # parameters and AdamW's step, exp_avg, exp_avg_sq
        torch.testing.assert_close(async_[k], sync[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    for r in results:
        assert r["extra"] == {"step": 1}
        assert r["finalized"] == out / "async1"
        for k, v in r["loaded"].items():  # a load of it gives step 1's weights, not step 3's
            torch.testing.assert_close(v, sync[f"model.{k}"], rtol=0, atol=0)


def test_save_is_invisible_until_final_and_defers_removals(two_ranks) -> None:
    out, results = two_ranks
    for r in results:
        assert r["in_flight"] == dict(polled=False, pending=out / "async1", visible=False, tmp=True, old_kept=True)
        assert r["old_after"] is False  # removed once async1 was final


def test_failed_background_write_keeps_the_previous_checkpoint(two_ranks) -> None:
    out, results = two_ranks
    for r in results:
        assert r["error"] is not None and f"writing checkpoint {out / 'async1'} failed" in r["error"], r["error"]
        assert "async1.tmp was not renamed" in r["error"]
        assert r["after_failure"] == dict(tmp=True, extra={"step": 1}, old2_kept=True, pending=None)
        assert r["loaded_extra"] == {"step": 1}
    assert "no space left on device" in results[0]["error"] + results[1]["error"]


def test_single_process_async_save_equals_sync_save(tmp_path: Path) -> None:
    from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointer
    from lightning_perf.parallel.checkpointing.checkpoint import read_extra, save_checkpoint, verify_files

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    save_checkpoint(tmp_path / "sync", model, [opt])
    saver = AsyncCheckpointer()
    saver.save(tmp_path / "async", model, [opt], extra={"step": 1})
    _step(model, opt, 1)  # in place, possibly while the background thread writes
    assert saver.wait() == tmp_path / "async" and saver.poll()
    verify_files(tmp_path / "async", read_extra(tmp_path / "async")["files"])
    sync, async_ = _read_shards(tmp_path / "sync"), _read_shards(tmp_path / "async")
    assert sync.keys() == async_.keys()
    for k in sync:
        torch.testing.assert_close(async_[k], sync[k], rtol=0, atol=0)
    assert not torch.equal(async_["model.0.weight"], model[0].weight.detach())  # the step after is not in it
    saver.close()
