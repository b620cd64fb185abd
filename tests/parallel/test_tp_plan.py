"""The GPT's tensor-parallel plan and its layout checks, and tp2 on two CPU processes (gloo).

The Trainer-level numerical checks (tp2 losses and parameters equal one process, with GQA,
RoPE, learned positions and a tied head) run in tests/strategies/test_parallel3d.py. Here
each two-rank test names its worker (``@pytest.mark.tp2("_cast_worker")``); one process group runs
the workers of every selected test in turn, and each test checks its worker's results.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
from _spawn import spawn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from lightning_perf.models.gpt import GPT, GPTConfig
from lightning_perf.parallel.model_parallel.tensor_parallel import (
    ReplicatedOutputNorm,
    find_protocol_module,
    tp_sequence_check,
)


class _Mesh:  # the plan reads only the mesh size
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _meta_gpt(**kw) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.from_name("tiny-llama", **kw))


def test_plan_covers_every_linear_with_gqa_and_sequence_parallel() -> None:
    model = _meta_gpt()
    plan = model.tensor_parallel_plan(_Mesh(2))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears <= set(plan)
    assert isinstance(plan["blocks.0.attn.k_proj"], ColwiseParallel)
    assert isinstance(plan["blocks.0.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["blocks.0.attn_norm"], SequenceParallel)
    assert isinstance(plan["blocks.0.attn"], PrepareModuleInput)
    assert isinstance(plan["norm"], ReplicatedOutputNorm)
    no_sp = model.tensor_parallel_plan(_Mesh(2), sequence_parallel=False)
    assert "blocks.0.attn_norm" not in no_sp and not no_sp["norm"].sequence_parallel


def test_plan_of_a_stage_names_only_its_modules() -> None:
    model = _meta_gpt(tie_embeddings=False)
    plan = model.pipeline_stage(1, 2).tensor_parallel_plan(_Mesh(2))
    assert not any(k.startswith(("tok_emb", "blocks.0.", "blocks.1.")) for k in plan)
    assert "lm_head" in plan and "blocks.3.mlp.up_proj" in plan
    with torch.device("meta"):
        learned = GPT(GPTConfig.from_name("tiny"))
    assert "pos_emb" in learned.tensor_parallel_plan(_Mesh(2))
    # a tied head on the last stage: the embedding's vocabulary rows, sharded as the first stage's tok_emb
    tied = learned.pipeline_stage(1, 2).tensor_parallel_plan(_Mesh(2))
    first = learned.pipeline_stage(0, 2).tensor_parallel_plan(_Mesh(2))
    assert type(tied["lm_head"]) is type(first["tok_emb"]) is RowwiseParallel and "tok_emb" not in tied


@pytest.mark.parametrize(
    "overrides, tp, match",
    [
        (dict(n_head=6, n_embd=384), 4, r"n_head \(6\) is not divisible by tensor_parallel_size \(4\)"),
        (dict(n_head=8, n_kv_head=2), 4, r"n_kv_head \(2\) is not divisible by tensor_parallel_size \(4\)"),
    ],
)
def test_heads_must_divide_by_tp(overrides, tp, match) -> None:
    cfg = GPTConfig.from_name("tiny-llama", **overrides)
    with pytest.raises(ValueError, match=match):
        cfg.check_parallel_layout(tensor_parallel_size=tp)


def test_layers_and_sequence_must_divide() -> None:
    cfg = GPTConfig.from_name("tiny-llama")
    with pytest.raises(ValueError, match=r"pp\(2\) \* stages_per_rank\(3\) = 6, 4 / 6"):
        cfg.check_parallel_layout(pipeline_parallel_size=2, stages_per_rank=3)
    with pytest.raises(ValueError, match="sequence length 15 is not divisible by tensor_parallel_size 2"):
        tp_sequence_check(15, 2, True)
    tp_sequence_check(15, 2, False)


def test_protocol_lookup_finds_the_outermost_implementer() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _meta_gpt()

    w = Wrapper()
    assert find_protocol_module(w, "tensor_parallel_plan") is w.model
    assert find_protocol_module(torch.nn.Linear(2, 2), "pipeline_stage") is None


def test_compile_scope_under_tensor_parallelism() -> None:
    from lightning_perf.parallel.compute.compile import compile_targets, tp_sublayers
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig
    from lightning_perf.parallel.model_parallel.parallelize_3d import _compile_mode

    model = _meta_gpt()
    block = model.blocks["0"]
    # the whole block, with or without TP (under TP with its hooks: norms and residual adds inside)
    assert compile_targets(block, tensor_parallel=True) == [block]
    assert compile_targets(block, tensor_parallel=False) == [block]
    assert tp_sublayers(block) == [block.attn, block.mlp]
    from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing

    apply_activation_checkpointing([block], "full")  # under TP a checkpointed block compiles its sublayers
    assert compile_targets(block, tensor_parallel=True) == [block.attn, block.mlp]
    assert compile_targets(block, tensor_parallel=False) == [block]
    with pytest.raises(ValueError, match="compile='fast' is not one of"):
        Parallel3DConfig(compile="fast")
    # blocks the module compiled itself are re-scoped under TP (compilation is lazy: nothing traced here)
    for b in model.blocks.values():
        b.compile()
    with pytest.warns(UserWarning, match="re-applied to each block, with its tensor-parallel hooks"):
        mode = _compile_mode(model, {0: model}, Parallel3DConfig(tensor_parallel_size=2))
    assert mode == "default"
    assert all(b._compiled_call_impl is None for b in model.blocks.values())
    # without TP the module's whole-block compile stays as it is; a whole-model one moves to the blocks
    model.blocks["1"].compile()
    stages = {1: model.pipeline_stage(1, 2)}
    assert _compile_mode(model, stages, Parallel3DConfig(pipeline_parallel_size=2)) is None
    assert model.blocks["1"]._compiled_call_impl is not None
    model.compile()
    with pytest.warns(UserWarning, match="re-applied to each pipeline stage's blocks"):
        assert _compile_mode(model, stages, Parallel3DConfig(pipeline_parallel_size=2)) == "default"
    assert model._compiled_call_impl is None and model.blocks["1"]._compiled_call_impl is not None
    # the mode a module says it compiles with (perf_settings(), as GPTLightningModule(compile=...) does) is kept
    from lightning_perf.perf import PerfSettings

    class Stating(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.model = inner

        def perf_settings(self) -> PerfSettings:
            return PerfSettings(compile_mode="max-autotune", compile_scope="block")

    model.blocks["0"].compile()
    with pytest.warns(UserWarning, match="re-applied to each block"):
        assert _compile_mode(Stating(model), {0: model}, Parallel3DConfig(tensor_parallel_size=2)) == "max-autotune"


# ---- two ranks: one process group runs the workers of every selected test -----------------------


_FAILED = "worker raised"


def _run_workers(workers: list, rank: int, world: int, out_dir) -> dict:
    """Each worker in turn on this rank; one that raises leaves its traceback and the rest still run."""
    out = {}
    for worker in workers:
        try:
            out[worker.__name__] = worker(rank, world, out_dir)
        except Exception:
            out[worker.__name__] = {_FAILED: traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def _tp2_group(request, tmp_path_factory) -> list[dict]:
    names = {item.get_closest_marker("tp2").args[0] for item in request.session.items
             if item.module is request.module and item.get_closest_marker("tp2") is not None}
    workers = [getattr(request.module, name) for name in sorted(names)]
    return spawn(functools.partial(_run_workers, workers), 2, tmp_path_factory.mktemp("tp2"), init_group=True,
                 timeout=1200)


@pytest.fixture
def tp2(request, _tp2_group) -> list:
    """The results of the test's ``@pytest.mark.tp2("worker")`` on ranks 0 and 1."""
    name = request.node.get_closest_marker("tp2").args[0]
    results = [r[name] for r in _tp2_group]
    for rank, r in enumerate(results):
        if isinstance(r, dict) and _FAILED in r:
            pytest.fail(f"{name} raised on rank {rank}:\n{r[_FAILED]}")
    return results


def _tp_graph_worker(rank: int, world: int, out_dir) -> dict:
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.compute.compile import compile_blocks
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp

    graphs: list[set] = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig.from_name("tiny", n_layer=3)
    torch.manual_seed(0)
    model = GPT(cfg)
    apply_tp(model, mesh, sequence_parallel=True, local_output=True)
    compile_blocks(list(model.blocks.values()), "default", backend=backend, tensor_parallel=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    # under autocast, as bf16-mixed runs it: the cast-then-gather input hook is traced into the graphs
    with loss_parallel(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    with loss_parallel():
        loss.backward()
    return {"graphs": graphs, "loss": float(loss.detach())}


@pytest.mark.tp2("_tp_graph_worker")
def test_tensor_parallel_block_graphs_hold_their_collectives(tp2) -> None:
    """Under sequence-parallel TP each compiled block graph holds its all-gathers, matmuls,
    reduce-scatters and the sequence-parallel norms (forward and backward): the layout Inductor's
    async TP rewrites. Three blocks share one forward and one backward graph (no recompilation
    per block)."""
    graphs = tp2[0]["graphs"]
    assert len(graphs) == 2, [sorted(g)[:5] for g in graphs]  # one block: forward + backward
    for ops in graphs:
        text = " ".join(ops)
        assert "all_gather_into_tensor" in text and "reduce_scatter_tensor" in text, sorted(ops)
        assert "aten.mm" in text or "aten.addmm" in text, sorted(ops)
        assert "layer_norm" in text, sorted(ops)  # the sequence-parallel norms are inside too
    assert tp2[0]["loss"] == tp2[1]["loss"]


def _reference_and_copy(preset: str, **overrides):
    """(tokens, one-process GPT after forward + backward, its loss, a fresh GPT of the same seed, built
    with ``overrides``)."""
    from lightning_perf.models.gpt import GPT, GPTConfig

    cfg = GPTConfig.from_name(preset, n_layer=2)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = GPT(cfg)
    ref_loss = ref(idx, idx)
    ref_loss.backward()
    torch.manual_seed(0)
    return idx, ref, float(ref_loss.detach()), GPT(GPTConfig.from_name(preset, n_layer=2, **overrides))


def _grad_errors(model: torch.nn.Module, ref: torch.nn.Module) -> dict[str, float]:
    """Per parameter, max |grad - reference grad| over the largest reference gradient (some are ~0
    exactly: a key bias shifts every score of a query equally); DTensor gradients are gathered."""
    from torch.distributed.tensor import DTensor

    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    out = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # Partial / Shard -> full
        out[name] = float((g - q.grad).abs().max()) / scale
    return out


def _loss_parallel_step_with_code(model: torch.nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """One forward + backward under ``loss_parallel``, and the code Inductor generated meanwhile."""
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.tensor.parallel import loss_parallel

    def step():
        with loss_parallel():
            loss = model(idx, idx)
            loss.backward()
        return loss

    return run_and_get_code(step)


def _unfused_bias_worker(rank: int, world: int, out_dir) -> dict:
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_perf.parallel.compute.compile import compile_blocks
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp, unfuse_linear_biases

    graphs: list[set] = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    idx, ref, ref_loss, model = _reference_and_copy("tiny")
    mesh = init_device_mesh("cpu", (world,))
    apply_tp(model, mesh, sequence_parallel=True, local_output=True)
    changed = unfuse_linear_biases(model, mesh, sequence_parallel=True)
    torch._dynamo.reset()
    compile_blocks(list(model.blocks.values()), "default", tensor_parallel=True,
                   backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    with loss_parallel():
        loss = model(idx, idx)
        loss.backward()
    return {"changed": changed, "loss": float(loss.detach()), "ref_loss": ref_loss,
            "worst_grad_rel": max(_grad_errors(model, ref).values()), "graphs": graphs}


@pytest.mark.tp2("_unfused_bias_worker")
def test_unfused_biases_keep_gradients_and_leave_bias_free_matmuls(tp2) -> None:
    """GPT-2 style (a bias on every projection) under tp2 + sequence parallel with the biases split
    from their matmuls (for async TP): the loss and every gradient equal one process's, and the
    compiled sublayer graphs hold ``mm`` only (``addmm`` is what async TP cannot fuse)."""
    for r in tp2:
        assert r["changed"] == 2 * 6  # q, k, v, o, up, down per block
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5 * abs(r["ref_loss"])
        assert r["worst_grad_rel"] < 1e-5, r["worst_grad_rel"]
        text = " ".join(" ".join(g) for g in r["graphs"])
        assert "aten.mm" in text and "aten.addmm" not in text
        assert len(r["graphs"]) == 2  # forward + backward: both blocks share them


def _cast_worker(rank: int, world: int, out_dir) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp, to_local_output

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, str]] = []
            self.phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "all_gather_into_tensor" in name or "reduce_scatter_tensor" in name:
                kind = "all_gather" if "all_gather" in name else "reduce_scatter"
                self.seen.append((f"{self.phase} {kind}", str(args[0].dtype)))
            return func(*args, **(kwargs or {}))

    cfg = GPTConfig.from_name("tiny", n_layer=2)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in ("plain", "cast"):
        torch.manual_seed(0)
        model = GPT(cfg)
        if name == "cast":
            apply_tp(model, mesh, sequence_parallel=True, local_output=True)
        else:  # the plan alone, without the pack's hooks
            parallelize_module(model, mesh, model.tensor_parallel_plan(mesh))
            model.register_forward_hook(lambda mod, args, o: to_local_output(o))
        mode = Collectives()
        with mode, loss_parallel(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
        mode.phase = "backward"
        with mode, loss_parallel():
            loss.backward()
        grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float() for p in model.parameters()]
        out[name] = {"loss": float(loss.detach()), "seen": mode.seen, "grads": grads}
    return out


@pytest.mark.tp2("_cast_worker")
def test_sequence_parallel_gathers_move_the_autocast_dtype(tp2) -> None:
    """bf16 autocast over tp2 + sequence parallel: the norms' fp32 outputs are cast to bf16 before
    their all-gather (and so their gradients are reduce-scattered in bf16): the forward is the same
    (the linears behind the gather ran in bf16 anyway), the gradients agree to bf16 rounding, and
    the block gathers move half the bytes."""
    for r in tp2:
        plain, cast = r["plain"], r["cast"]
        assert cast["loss"] == plain["loss"]
        gathers = lambda seen: [d for k, d in seen if k == "forward all_gather"]  # noqa: E731
        # 2 blocks x (attention + MLP), then the final norm (ReplicatedOutputNorm casts in both runs)
        assert gathers(plain["seen"]) == ["torch.float32"] * 4 + ["torch.bfloat16"], plain["seen"]
        assert gathers(cast["seen"]) == ["torch.bfloat16"] * 5, cast["seen"]
        # and their gradients: backward reduce-scatters (the embeddings' fp32 gathers stay)
        scatters = lambda seen: [d for k, d in seen if k == "backward reduce_scatter"]  # noqa: E731
        assert scatters(plain["seen"]).count("torch.float32") == 4, plain["seen"]
        assert scatters(cast["seen"]).count("torch.float32") == 0, cast["seen"]
        scale = max(float(g.abs().max()) for g in plain["grads"])
        worst = max(float((a - b).abs().max()) for a, b in zip(cast["grads"], plain["grads"]))
        assert 0 < worst < 2e-2 * scale, worst / scale


def _llama_compiled_worker(rank: int, world: int, out_dir) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_perf.parallel.compute.compile import compile_blocks
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp

    # no position table: the vocab-parallel embedding feeds block 0 directly
    idx, ref, ref_loss, model = _reference_and_copy("tiny-llama")
    apply_tp(model, init_device_mesh("cpu", (world,)), sequence_parallel=True, local_output=True)
    torch._dynamo.reset()
    compile_blocks(list(model.blocks.values()), "default", backend="aot_eager", tensor_parallel=True)
    with loss_parallel():
        loss = model(idx, idx)
        loss.backward()
    return {"loss": float(loss.detach()), "ref_loss": ref_loss, "worst": _grad_errors(model, ref)}


@pytest.mark.tp2("_llama_compiled_worker")
def test_compiled_tp_blocks_fed_by_the_embedding_match_one_process(tp2) -> None:
    """Llama-style tp2 + sequence parallel, blocks compiled with their hooks: the first block's input
    is the vocab-parallel embedding's ``to_local()`` view, which as a raw graph input gets a wrong
    gradient (the embedding's) or crashes DTensor's backward; every gradient equals one process's."""
    for r in tp2:
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5 * abs(r["ref_loss"])
        bad = {k: v for k, v in r["worst"].items() if v > 1e-5}
        assert not bad, bad


@functools.lru_cache(maxsize=None)
def _inductor_tp_step(preset: str, sequence_parallel, tp_overlap: str, world: int) -> dict:
    """This rank's tp2 step of ``preset`` with its blocks compiled by Inductor: loss, the reference loss,
    the gradient errors and the generated code. Once per process and configuration: several workers
    check the same run."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_perf.parallel.compute.compile import compile_blocks
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp

    idx, ref, ref_loss, model = _reference_and_copy(preset)
    apply_tp(model, init_device_mesh("cpu", (world,)), sequence_parallel=sequence_parallel, local_output=True)
    torch._dynamo.reset()
    compile_blocks(list(model.blocks.values()), "default", tensor_parallel=True, tp_overlap=tp_overlap)
    loss, codes = _loss_parallel_step_with_code(model, idx)
    return {"loss": float(loss.detach()), "ref_loss": ref_loss, "worst": _grad_errors(model, ref), "codes": codes}


def _overlap_worker(rank: int, world: int, out_dir) -> dict:
    import re

    out = {}
    for mode in ("none", "reorder", "reorder_peak_memory"):
        step = _inductor_tp_step("tiny", True, mode, world)
        codes = step["codes"]
        # per compiled graph: the matmuls that run between a collective's launch and its wait
        hidden = []
        for code in codes:
            body = code[code.index("def call("):]
            for m in re.finditer(r"(buf\d+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|"
                                 r"reduce_scatter_tensor)\.default\(", body):
                wait = body.index(f"wait_tensor.default({m.group(1)})", m.end())
                hidden.append(len(re.findall(r"extern_kernels\.(?:mm|addmm)\(", body[m.end():wait])))
        out[mode] = {"loss": step["loss"], "ref_loss": step["ref_loss"], "worst": step["worst"], "hidden": hidden,
                     "graphs": len(codes)}
    return out


@pytest.mark.tp2("_overlap_worker")
def test_inductor_overlaps_tp_collectives_with_weight_gradient_matmuls(tp2) -> None:
    """Blocks compiled by Inductor under tp2 + sequence parallel: left as issued, every collective is
    waited on before any other matmul runs; with either reordering mode some of the backward's
    collectives run while weight-gradient matmuls compute, and loss and every gradient still equal
    one process's."""
    for r in tp2:
        none = r["none"]
        assert sum(none["hidden"]) == 0, none["hidden"]
        for mode in ("reorder", "reorder_peak_memory"):
            assert sum(1 for h in r[mode]["hidden"] if h) >= 1, (mode, r[mode]["hidden"])
        for res in r.values():
            assert res["graphs"] == 2  # one forward, one backward: shared by the blocks
            assert len(res["hidden"]) == 8  # 2 gathers + 2 scatters, each way
            assert abs(res["loss"] - res["ref_loss"]) < 1e-5 * abs(res["ref_loss"])
            bad = {k: v for k, v in res["worst"].items() if v > 1e-5}
            assert not bad, bad


def _batch_shard_worker(rank: int, world: int, out_dir) -> dict:
    import re

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    out = {}
    for preset in ("tiny", "tiny-llama"):  # learned position table / RoPE
        for sp in (True, "batch"):
            step = _inductor_tp_step(preset, sp, "none", world)
            kernels = {k for code in step["codes"] for k in re.findall(r"\b(cpp_fused_\w+) = ", code)}
            out[(preset, sp)] = {"loss": step["loss"], "ref_loss": step["ref_loss"], "worst": step["worst"],
                                 "relayout": sorted(k for k in kernels if re.search(r"_cat(_|$)", k))}
    # a batch the TP ranks cannot share evenly (3 sequences over 2 ranks, a ragged last batch): padded
    # with a copy of the last sequence whose targets the loss ignores, outputs cut back to 3
    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig
    from lightning_perf.parallel.model_parallel.parallelize_3d import parallelize_3d

    cfg = GPTConfig.from_name("tiny", n_layer=2)
    odd = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    ref = GPT(cfg)
    ref_loss = ref(odd, odd)
    ref_loss.backward()
    ref_logits = ref(odd).detach()
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("pp", "dp", "tp"))
    parallelize_3d(model, Parallel3DConfig(tensor_parallel_size=world, sequence_parallel="batch"), mesh,
                   device=torch.device("cpu"))
    with loss_parallel():
        loss = model(odd, targets=odd)
        loss.backward()
    logits = model(odd)
    out["odd_batch"] = {"loss": float(loss.detach()), "ref_loss": float(ref_loss.detach()),
                        "worst": _grad_errors(model, ref), "logits_err": float((logits - ref_logits).abs().max()),
                        "logits_shape": tuple(logits.shape)}
    # a model that names no ignored target cannot be padded: refused with the numbers
    type(model).batch_padding_target = None
    try:
        model(odd)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    finally:
        type(model).batch_padding_target = -100
    return out


@pytest.mark.tp2("_batch_shard_worker")
def test_batch_sharded_residual_stream_matches_one_process_without_relayout_copies(tp2) -> None:
    """tp2 with the residual stream sharded along the batch (``sequence_parallel="batch"``), blocks
    compiled by Inductor with their hooks: loss and every gradient equal one process's, for learned
    positions (a replicated table added to batch-sharded token rows) and RoPE; the compiled graphs
    hold no cat/split re-layout kernels, which sharding the sequence needs around every collective;
    an odd batch (3 sequences on 2 ranks) is padded with an ignored sequence: same loss, gradients and
    logits as one process; a model naming no ignored target refuses it before the first collective."""
    for r in tp2:
        for key, res in r.items():
            if key == "refused":
                continue
            assert abs(res["loss"] - res["ref_loss"]) < 1e-5 * abs(res["ref_loss"]), key
            bad = {k: v for k, v in res["worst"].items() if v > 1e-5}
            assert not bad, (key, sorted(bad.items(), key=lambda kv: -kv[1])[:6], r)
        for preset in ("tiny", "tiny-llama"):
            assert r[(preset, True)]["relayout"], preset  # sequence sharding: re-layout copies
            assert r[(preset, "batch")]["relayout"] == [], r[(preset, "batch")]["relayout"]
        odd = r["odd_batch"]
        assert odd["logits_shape"][0] == 3 and odd["logits_err"] < 1e-5, odd
        assert r["refused"] is not None and "batch of 3" in r["refused"] and "tensor_parallel_size 2" in r["refused"]


def test_sequence_parallel_values_are_checked() -> None:
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig
    from lightning_perf.parallel.layout.validate import check_data_layout
    from lightning_perf.strategies import Parallel3DStrategy

    with pytest.raises(ValueError, match="sequence_parallel='tokens' is not one of"):
        Parallel3DStrategy(tensor_parallel_size=2, sequence_parallel="tokens")
    Parallel3DConfig(tensor_parallel_size=2, sequence_parallel="batch")
    # per data-parallel rank: 6 sequences in 2 microbatches of 3 cannot split over tp=2
    from lightning_perf.parallel.model_parallel.pipeline import PipelineConfig

    with pytest.raises(ValueError, match=r"batch of 6 in 2 microbatch\(es\) gives 3 sequences"):
        check_data_layout(batch_size=6, seq_len=16, tensor_parallel_size=2, sequence_parallel="batch",
                          pipeline=PipelineConfig(pipeline_parallel_size=2, schedule="1f1b", num_microbatches=2))
    # the sequence is not split
    check_data_layout(batch_size=8, seq_len=15, tensor_parallel_size=2, sequence_parallel="batch")
    with pytest.raises(ValueError, match="splits seq_len=15 over tp=2"):
        check_data_layout(batch_size=8, seq_len=15, tensor_parallel_size=2, sequence_parallel=True)


def test_compile_head_loss_only_where_the_head_lives() -> None:
    """The strategy compiles the last stage's head + loss once; a stage without the head is left alone,
    and the compiled loss equals the eager one."""
    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.compute.compile import compile_head_loss

    cfg = GPTConfig.from_name("tiny", n_layer=2, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    eager = float(model(idx, idx))
    first, last = model.pipeline_stage(0, 2), model.pipeline_stage(1, 2)
    assert not compile_head_loss(first, "default", backend="aot_eager")  # no norm / head on stage 0
    assert compile_head_loss(model, "default", backend="aot_eager")
    assert not compile_head_loss(model, "default", backend="aot_eager")  # already compiled
    assert compile_head_loss(last, "default", backend="aot_eager")
    torch._dynamo.reset()
    assert float(model(idx, idx)) == pytest.approx(eager, rel=1e-6)


def _fused_qkv_worker(rank: int, world: int, out_dir) -> dict:
    import re

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_perf.parallel.compute.compile import compile_blocks
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp, unfuse_linear_biases

    out = {}
    # (preset, sequence_parallel, compiled, biases split from their matmuls as for async TP)
    for preset, sp, compiled, unfuse in (("tiny", False, False, False), ("tiny", "batch", True, True),
                                         ("tiny-llama", True, True, False)):
        idx, ref, ref_loss, model = _reference_and_copy(preset, fused_qkv=True)
        mesh = init_device_mesh("cpu", (world,))
        apply_tp(model, mesh, sequence_parallel=sp, local_output=True)
        if unfuse:
            unfuse_linear_biases(model, mesh, sequence_parallel=sp)
        torch._dynamo.reset()
        if compiled:
            compile_blocks(list(model.blocks.values()), "default", tensor_parallel=True, tp_overlap="none")

        if compiled:
            loss, codes = _loss_parallel_step_with_code(model, idx)
            forward = codes[0][codes[0].index("def call("):]
            matmuls = len(re.findall(r"extern_kernels\.(?:mm|addmm)\(", forward))
        else:
            with loss_parallel():
                loss = model(idx, idx)
                loss.backward()
            matmuls = None
        out[(preset, sp)] = {"loss": float(loss.detach()), "ref_loss": ref_loss, "worst": _grad_errors(model, ref),
                             "forward_matmuls": matmuls}
    return out


@pytest.mark.tp2("_fused_qkv_worker")
def test_fused_qkv_under_tensor_parallelism_matches_one_process(tp2) -> None:
    """``GPTConfig(fused_qkv=True)`` under tp2: the three column-parallel weights' local rows form one
    matmul; loss and every q/k/v gradient equal one unfused process's (replicated, sequence- and
    batch-sharded streams; biases split for async TP), and a compiled block's forward runs 3 matmuls
    (q/k/v, o, up; plus down for 4) instead of 6."""
    for r in tp2:
        for key, res in r.items():
            assert abs(res["loss"] - res["ref_loss"]) < 1e-5 * abs(res["ref_loss"]), key
            bad = {k: v for k, v in res["worst"].items() if v > 1e-5}
            assert not bad, (key, sorted(bad.items(), key=lambda kv: -kv[1])[:6], r)
        assert r[("tiny", "batch")]["forward_matmuls"] == 4  # qkv, o, up, down
        assert r[("tiny-llama", True)]["forward_matmuls"] == 5  # qkv, o, gate, up, down


def test_tp_overlap_modes_map_to_inductor_options() -> None:
    from lightning_perf.parallel.compute.compile import _hooked_compile, inductor_overlap_options
    from lightning_perf.parallel.layout.config_3d import Parallel3DConfig

    assert inductor_overlap_options("none", "cuda") == {}
    reorder = inductor_overlap_options("reorder", "cpu")
    assert reorder["reorder_for_compute_comm_overlap"] is True
    assert reorder["reorder_for_compute_comm_overlap_passes"][-1] == "reorder_compute_for_overlap"
    assert "reorder_communication_preserving_peak_memory" in \
        inductor_overlap_options("reorder_peak_memory", "cpu")["reorder_for_compute_comm_overlap_passes"]
    # the runtime-estimated scheduler times ops on the GPU: elsewhere it falls back to "reorder"
    assert inductor_overlap_options("schedule", "cuda") == {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    assert inductor_overlap_options("schedule", "cpu") == reorder
    # every option name exists in this torch's Inductor config (torch.compile would reject it)
    from torch._inductor import config as inductor_config

    for mode in ("reorder", "reorder_peak_memory"):
        for name in inductor_overlap_options(mode, "cpu"):
            assert hasattr(inductor_config, name), name
    assert hasattr(inductor_config.aten_distributed_optimizations, "enable_overlap_scheduling")
    # a compile mode's own options join ours (torch.compile takes a mode or options, not both)
    assert _hooked_compile("max-autotune-no-cudagraphs", "inductor", "reorder") is not None
    with pytest.raises(ValueError, match="tp_overlap='fast' is not one of"):
        Parallel3DConfig(tp_overlap="fast")


def _split_worker(rank: int, world: int, out_dir) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_perf.parallel.compute import compile as pc
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp

    calls = {"split": 0, "whole": 0}
    original = pc._run_hooked_split

    def counting(whole, split, module, *args, **kwargs):
        calls["split" if args and pc._splittable(args[0], 2) else "whole"] += 1
        return original(whole, split, module, *args, **kwargs)

    pc._run_hooked_split = counting
    out = {}
    try:
        for preset, sp in (("tiny", "batch"), ("tiny-llama", True)):
            idx, ref, ref_loss, model = _reference_and_copy(preset)
            idx = torch.cat([idx, idx.flip(0)])  # 4 sequences: 2 per rank under batch sharding, split in two
            torch.manual_seed(0)
            ref = type(ref)(ref.config)
            ref_loss = ref(idx, idx)
            ref_loss.backward()
            apply_tp(model, init_device_mesh("cpu", (world,)), sequence_parallel=sp, local_output=True)
            torch._dynamo.reset()
            pc.compile_blocks(list(model.blocks.values()), "default", backend="aot_eager", tensor_parallel=True,
                               tp_split=2)
            with loss_parallel():
                loss = model(idx, idx)
                loss.backward()
            out[(preset, sp)] = {"loss": float(loss.detach()), "ref_loss": float(ref_loss.detach()),
                                 "worst": _grad_errors(model, ref), "calls": dict(calls)}
            calls.update(split=0, whole=0)
    finally:
        pc._run_hooked_split = original
    return out


@pytest.mark.tp2("_split_worker")
def test_tp_split_halves_match_one_process(tp2) -> None:
    """``tp_split=2``: each compiled TP block runs two halves of its batch in one graph; loss and every
    gradient equal one process's. Blocks fed a plain tensor are split; the batch-sharded first block
    fed a DTensor (token rows + replicated position table) runs whole."""
    for r in tp2:
        for key, res in r.items():
            assert abs(res["loss"] - res["ref_loss"]) < 1e-5 * abs(res["ref_loss"]), key
            bad = {k: v for k, v in res["worst"].items() if v > 1e-5}
            assert not bad, (key, sorted(bad.items(), key=lambda kv: -kv[1])[:6], r)
        assert r[("tiny", "batch")]["calls"] == {"split": 1, "whole": 1}  # block 0 gets the DTensor
        assert r[("tiny-llama", True)]["calls"] == {"split": 2, "whole": 0}


def _fp8_worker(rank: int, world: int, out_dir) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_perf.models.gpt import GPT, GPTConfig
    from lightning_perf.parallel.compute.compile import compile_blocks
    from lightning_perf.parallel.model_parallel.tensor_parallel import apply_tp

    from lightning_perf.models.gpt import parallelize

    out = {}
    original = parallelize._fp8_collectives  # restored: later workers share this process
    # (preset, sequence_parallel, compiled, recipe, fused q/k/v); torchao's FP8 styles need FP8
    # collectives (NCCL): on gloo only the replicated stream, which has none, runs them
    try:
        for preset, sp, compiled, recipe, fused in (("tiny", True, False, "tensorwise", False),
                                                    ("tiny", False, False, "tensorwise", False),
                                                    ("tiny-llama", "batch", False, "tensorwise", False),
                                                    ("tiny", False, True, "tensorwise", False),
                                                    ("tiny-llama", True, False, "rowwise", False),
                                                    ("tiny", True, False, "tensorwise", True)):
            cfg = GPTConfig.from_name(preset, n_layer=2, fp8=recipe, fused_qkv=fused)
            idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
            torch.manual_seed(0)
            # the reference: one process, the same FP8 linears (q/k/v as three matmuls, as under TP)
            ref = GPT(cfg.replace(fused_qkv=False))
            ref_loss = ref(idx, idx)
            ref_loss.backward()
            torch.manual_seed(0)
            model = GPT(cfg)
            mesh = init_device_mesh("cpu", (world,))
            fp8_styles = sp is False and not compiled
            parallelize._fp8_collectives = lambda m, on=fp8_styles: on
            styles = sorted({type(st).__name__ for st in model.tensor_parallel_plan(mesh).values()})
            apply_tp(model, mesh, sequence_parallel=sp, local_output=True)
            torch._dynamo.reset()
            if compiled:  # Dynamo + AOTAutograd over torchao's subclasses (Inductor's code is tested elsewhere)
                compile_blocks(list(model.blocks.values()), "default", backend="aot_eager", tensor_parallel=True,
                               tp_overlap="none")
            with loss_parallel():
                loss = model(idx, idx)
                loss.backward()
            out[(preset, sp, compiled, recipe, fused)] = {"loss": float(loss.detach()), "ref_loss": float(ref_loss),
                                                          "worst": _grad_errors(model, ref), "styles": styles}
    finally:
        parallelize._fp8_collectives = original
    return out


@pytest.mark.tp2("_fp8_worker")
def test_fp8_linears_under_tensor_parallelism_match_one_process(tp2) -> None:
    """FP8 linears under tp2 (torchao: tensorwise through its FP8 tensor-parallel styles, whose scales
    are the whole tensor's, rowwise through the plain styles) give the loss and gradients of one process
    with the same FP8 linears (sequence-, batch-sharded and replicated streams, compiled, fused q/k/v).

    Held to FP8 resolution: the row-parallel matmuls sum their partial products across ranks, and an
    activation one fp32 ulp away from the one-process value can round to the neighbouring FP8 value,
    so a few gradient elements move by up to a few percent of the largest (rowwise: twice that, its
    partial products are rounded to bf16 on each rank before they are summed)."""
    for r in tp2:
        for (preset, sp, compiled, recipe, fused), res in r.items():
            key = (preset, sp, compiled, recipe, fused)
            float8_styles = recipe == "tensorwise" and sp is False and not compiled
            assert ("Float8ColwiseParallel" in res["styles"]) == float8_styles, (key, res["styles"])
            assert abs(res["loss"] - res["ref_loss"]) < 1e-3 * abs(res["ref_loss"]), (key, res["loss"], res["ref_loss"])
            # rowwise FP8 matmuls write bf16: each rank's partial product is rounded before the sum
            bad = {k: v for k, v in res["worst"].items() if v > (0.05 if recipe == "tensorwise" else 0.1)}
            assert not bad, (key, bad)
