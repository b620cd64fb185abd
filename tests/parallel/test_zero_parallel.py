"""Pure torch.distributed pieces of the ZeRO stack on 2 CPU processes (gloo).

One spawned group runs every check (spawning costs more than the checks): loss-scaler
agreement, FSDP2 ZeRO-2/3 through ``apply_fsdp`` against a single-process run,
per-rank memory fractions, sharded checkpoint save -> load -> continue, and the
consolidated file loading into a plain GPT.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _spawn import spawn as _spawn

from lightning_perf.models.gpt import GPT, GPTConfig

WORLD = 2
STEPS = 4
B, T = 2, 16  # per rank
LR = 1e-2


def tiny_config(fp8: bool = False, n_layer: int = 2) -> GPTConfig:
    return GPTConfig(name="t", vocab_size=100, block_size=T, n_layer=n_layer, n_head=2, n_embd=32, pad_vocab_multiple=16,
                     bias=False,  # a k_proj bias has a zero true gradient: Adam would amplify rounding noise
                     fp8=fp8)


def batches(n_steps: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n_steps):
        x = torch.randint(0, 100, (world * B, T + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out




# ---- the distributed part ------------------------------------------------------------------


def _fsdp_run(rank: int, world: int, stage: int, data, ckpt: Path | None, fp8: bool = False, blocks_per_unit: int = 1,
              n_layer: int = 2):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_perf.parallel import apply_fsdp, load_checkpoint, save_checkpoint
    from lightning_perf.parallel.checkpointing.checkpoint import full_model_state_dict
    from lightning_perf.parallel.sharding.init import materialize_from_rank0, take_full_state

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    if rank == 0:
        model = GPT(tiny_config(fp8, n_layer))  # the single-process random stream
        full = take_full_state(model)
    else:
        with torch.device("meta"):
            model = GPT(tiny_config(fp8, n_layer))
        full = None
    apply_fsdp(model, mesh, reshard_after_forward=stage == 3, prefetch=1, blocks_per_unit=blocks_per_unit)
    materialize_from_rank0(model, torch.device("cpu"), full)
    init_state = full_model_state_dict(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    out: dict = {"init": init_state,
                 "block_units": len({id(b._get_fsdp_state()) for b in model.blocks.values()})}
    for i, (x, y) in enumerate(data):
        xs, ys = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
        loss = model(xs, ys)
        loss.backward()
        if i == 0:
            out["grad_local"] = sum(p.grad.to_local().numel() for p in model.parameters())
            out["param_local_at_rest"] = sum(p.to_local().numel() for p in model.parameters())
        opt.step()
        opt.zero_grad()
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / world)
        if ckpt is not None and i == 1:
            save_checkpoint(ckpt, model, [opt], extra={"step": i + 1})
            out["at_save"] = full_model_state_dict(model)
    out["losses"] = losses
    out["final"] = full_model_state_dict(model)
    out["opt_local"] = sum(t.to_local().numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    if ckpt is not None:
        # a fresh model (ZeRO-3 always: resharding between stages is free) resumes from step 2
        with torch.device("meta"):
            model2 = GPT(tiny_config())
        apply_fsdp(model2, mesh, reshard_after_forward=True)
        model2.to_empty(device="cpu")
        opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
        extra = load_checkpoint(ckpt, model2, [opt2])
        resumed = []
        for x, y in data[extra["step"]:]:
            xs, ys = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
            loss = model2(xs, ys)
            loss.backward()
            opt2.step()
            opt2.zero_grad()
            l = loss.detach().clone()
            dist.all_reduce(l)
            resumed.append(l.item() / world)
        out["resumed"] = resumed
    return out


def _worker(rank: int, world: int, out_dir: Path) -> dict:
    from lightning_perf.parallel import DistributedLossScaler

    res: dict = {}
    # 1. loss scaler: an inf on rank 1 only -> every rank skips and halves the scale
    scaler = DistributedLossScaler(init_scale=1024.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 1024.0)
    if rank == 1:
        p.grad[2] = float("inf")
    found = scaler.unscale_([p])
    scaler.update(found)
    p.grad = torch.full((4,), 512.0)
    found2 = scaler.unscale_([p])
    scaler.update(found2)
    res["scaler"] = (found, found2, scaler.loss_scale, scaler.skipped_steps, p.grad.tolist())
    # 2. FSDP2 ZeRO-2 / ZeRO-3 vs one process; ZeRO-3 also checkpoints and resumes
    data = batches(STEPS, world)
    res["zero2"] = _fsdp_run(rank, world, 2, data, None)
    res["zero3"] = _fsdp_run(rank, world, 3, data, out_dir / "ckpt")
    # 3. FP8 linears under ZeRO-3: each rank quantises its own half of the batch
    res["zero3_fp8"] = _fsdp_run(rank, world, 3, data, None, fp8=True)
    # 4. three blocks sharded two to a unit (units of 2 and 1 blocks, prefetch across them)
    res["zero3_grouped"] = _fsdp_run(rank, world, 3, data, None, blocks_per_unit=2, n_layer=3)
    return res


def reference(data, steps: int, n_layer: int = 2):
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=n_layer))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, at = [], {}
    for i, (x, y) in enumerate(data[:steps]):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i == 1:
            at = {k: v.clone() for k, v in model.state_dict().items()}
    return init, losses, model.state_dict(), at


def reference_per_rank_halves(data, steps: int, world: int, fp8: bool):
    """One process, each step's batch in ``world`` slices with gradients accumulated (loss / world each):
    what data parallelism computes when the forward depends on the slice (FP8 scales per activation)."""
    torch.manual_seed(0)
    model = GPT(tiny_config(fp8))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in data[:steps]:
        total = 0.0
        for r in range(world):
            loss = model(x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])
            (loss / world).backward()
            total += loss.item() / world
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def _close(a: dict, b: dict, rtol=1e-5, atol=1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def test_zero_parallel_pieces(tmp_path: Path) -> None:
    results = _spawn(_worker, WORLD, tmp_path, timeout=120.0, init_group=True)
    # loss scaler: both ranks saw the inf, both skipped, scale halved then unchanged (interval 2)
    for r in results:
        found, found2, scale, skipped, grad = r["scaler"]
        assert found is True and found2 is False
        assert scale == 512.0 and skipped == 1
        assert grad == [1.0] * 4

    data = batches(STEPS, WORLD)
    init, losses, final, at_two = reference(data, STEPS)
    n_params = sum(v.numel() for v in init.values())
    for stage in (2, 3):
        r0 = results[0][f"zero{stage}"]
        _close(r0["init"], init, rtol=0, atol=0)  # rank 0's stream == one process's
        torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        _close(r0["final"], final)
        for r in results:
            z = r[f"zero{stage}"]
            # every parameter is sharded on dim 0 (padding at most one row per tensor)
            assert z["grad_local"] <= n_params / WORLD + 1000
            assert z["param_local_at_rest"] <= n_params / WORLD + 1000
            assert z["opt_local"] <= 2 * (n_params / WORLD + 1000)  # exp_avg + exp_avg_sq
    # FP8 linears under ZeRO-3 = one process accumulating the ranks' slices (the quantisation scales are
    # per slice; a power-of-two loss scale leaves the FP8 gradients exact), and within FP8 error of bf16
    fp8_losses, fp8_final = reference_per_rank_halves(data, STEPS, WORLD, fp8=True)
    z = results[0]["zero3_fp8"]
    torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(fp8_losses), rtol=1e-5, atol=1e-6)
    _close(z["final"], fp8_final)
    assert max(abs(a - b) for a, b in zip(z["losses"], losses)) < 0.05
    # consecutive blocks grouped into FSDP units: the same training as one process
    _, losses3, final3, _ = reference(data, STEPS, n_layer=3)
    for r in results:
        assert r["zero3_grouped"]["block_units"] == 2 and r["zero3"]["block_units"] == 2
    torch.testing.assert_close(torch.tensor(results[0]["zero3_grouped"]["losses"]), torch.tensor(losses3), rtol=1e-5,
                               atol=1e-6)
    _close(results[0]["zero3_grouped"]["final"], final3)
    # resume from the step-2 checkpoint = uninterrupted run
    torch.testing.assert_close(torch.tensor(results[0]["zero3"]["resumed"]), torch.tensor(losses[2:]),
                               rtol=1e-5, atol=1e-6)
    # consolidate -> one file a plain GPT loads
    from lightning_perf.parallel.checkpointing.checkpoint import main as consolidate_main

    out = tmp_path / "full.pt"
    assert consolidate_main([str(tmp_path / "ckpt"), str(out)]) == 0
    assert consolidate_main(["--ckpt_dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "full2.pt")]) == 0
    plain = GPT(tiny_config())
    plain.load_state_dict(torch.load(out, weights_only=True))
    _close(plain.state_dict(), at_two)
    assert not (tmp_path / "ckpt.tmp").exists()


def test_find_blocks_generic_models() -> None:
    from lightning_perf.parallel import find_blocks

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

    class HFStyle(torch.nn.Module):  # blocks at model.layers, as in Hugging Face decoders
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(Layer() for _ in range(3))
            self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 2), torch.nn.ReLU()])

    m = HFStyle()
    assert find_blocks(m) == list(m.model.layers)
    assert find_blocks(m, {Layer}) == list(m.model.layers)
    assert find_blocks(m, lambda mod: isinstance(mod, torch.nn.Linear)) == [l.fc for l in m.model.layers] + [m.heads[0]]
    gpt = GPT(tiny_config())
    assert find_blocks(gpt) == list(gpt.blocks.values())
    with pytest.raises(ValueError, match="set of nn.Module classes"):
        find_blocks(m, {int})


def test_checkpoint_saves_are_atomic(tmp_path: Path) -> None:
    """One process, no process group: a crash mid-save never costs the previous checkpoint."""
    import pickle

    from lightning_perf.parallel import load_checkpoint, save_checkpoint
    from lightning_perf.parallel.checkpointing.checkpoint import update_link

    torch.manual_seed(0)
    model = GPT(tiny_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = batches(1, 1)[0]
    model(x, y).backward()
    opt.step()
    path = tmp_path / "step1"
    save_checkpoint(path, model, [opt], extra={"step": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    # a later save of the same path crashed while writing: its .tmp is partial
    (tmp_path / "step1.tmp").mkdir()
    (tmp_path / "step1.tmp" / "__0_0.distcp").write_bytes(b"partial")
    fresh = GPT(tiny_config())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    assert load_checkpoint(path, fresh, [fresh_opt]) == {"step": 1}
    _close(fresh.state_dict(), saved, rtol=0, atol=0)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    # overwriting works (the stale .tmp is replaced), and a crash between the two renames
    # leaves <path>.old, which load_checkpoint falls back to
    save_checkpoint(path, model, [opt], extra={"step": 2})
    assert not (tmp_path / "step1.tmp").exists()
    path.rename(tmp_path / "step1.old")
    assert load_checkpoint(path, fresh, [fresh_opt]) == {"step": 2}
    # the "last" link moves atomically, and loads
    update_link(tmp_path / "last", tmp_path / "step1.old")
    update_link(tmp_path / "last", tmp_path / "step1.old")
    assert (tmp_path / "last").is_symlink() and load_checkpoint(tmp_path / "last", fresh)["step"] == 2
    # loads are weights_only: arbitrary pickled objects in the extra state are refused
    save_checkpoint(tmp_path / "unsafe", model, extra={"obj": tiny_config()})
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(tmp_path / "unsafe", fresh)
