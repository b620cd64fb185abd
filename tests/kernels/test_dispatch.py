"""The GPT with Triton kernels vs the PyTorch paths; dispatch fallbacks; autotune cache; compile and checkpointing."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_perf.kernels import dispatch, flash_attention, fused_linear_cross_entropy, layer_norm, swiglu
from lightning_perf.kernels.attention_backends import LIBRARY_BACKENDS, SDPA_BACKENDS
from lightning_perf.kernels.autotune import AutotuneCache, KernelTuner, shape_bucket, software_versions
from lightning_perf.kernels.ops.flash_attention import attention_reference
from lightning_perf.models.gpt import GPT, GPTConfig


@pytest.mark.gpu(cpu=True)
# on a GPU "relaunching" compiles every configuration of every kernel, and the GPU run's own tuner already
# launches each key's first call twice
@pytest.mark.parametrize("tuner", ["default", pytest.param("relaunching", marks=pytest.mark.gpu_slow)])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_gpt_with_triton_kernels_matches_torch(preset, tuner, close, device, model_dtype, request):
    """Loss and every parameter gradient agree: norms, activations, attention (GQA for llama), fused loss.

    "relaunching": every kernel call first launches each of its configurations twice, as the tuner does
    on a GPU for a key's first call; a kernel whose launches are not repeatable would disagree here.
    """
    if tuner == "relaunching":
        request.getfixturevalue("relaunching_tuner")
    dtype, f = model_dtype
    cfg = GPTConfig.from_name(preset, n_layer=1)
    torch.manual_seed(0)
    ref = GPT(cfg).to(device, dtype)
    tri = GPT(cfg.replace(kernels="triton", attention="triton")).to(device, dtype)
    tri.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen).to(device)
    targets[0, :3] = -100
    loss_ref, loss_tri = ref(idx, targets), tri(idx, targets)
    close(loss_tri, loss_ref, 1e-5 * f, 1e-5 * f, "loss")
    loss_ref.backward()
    loss_tri.backward()
    for (name, p_ref), p_tri in zip(ref.named_parameters(), tri.parameters()):
        close(p_tri.grad, p_ref.grad, 2e-5 * f, 1e-4 * min(f, 100.0), f"grad of {name}")


@pytest.mark.gpu(cpu=True)
@pytest.mark.parametrize("elementwise", ["triton", "inductor"])
def test_compiled_gpt_has_no_graph_break(elementwise, close, device, model_dtype, monkeypatch):
    """The GPT with every kernel compiles as one graph (``fullgraph=True`` raises on a break) and agrees.

    With ``elementwise_under_compile="inductor"`` (the default) the traced graph holds our attention
    and loss ops but leaves norms and activations to Inductor; with "triton" it holds all of them.
    """
    monkeypatch.setattr(dispatch._Default, "dispatcher",
                        dispatch.KernelDispatcher(elementwise_under_compile=elementwise))
    dtype, f = model_dtype
    cfg = GPTConfig.from_name("tiny-llama", n_layer=1, kernels="triton", attention="triton")
    torch.manual_seed(0)
    model = GPT(cfg).to(device, dtype)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen).to(device)
    eager = model(idx, targets)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(idx, targets)
    close(loss, eager, 1e-5 * f, 1e-5 * f, "compiled loss")
    for (name, _), g, e in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters())),
                               eager_grads):
        close(g, e, 1e-5 * f, 1e-5 * f, f"compiled grad of {name}")
    ours = {t for t in seen if "lightning_perf" in t}
    assert any("flash_attn" in t for t in ours) and any("fused_linear_cross_entropy" in t for t in ours), seen
    elementwise_ops = {t for t in ours if "row_norm" in t or "swiglu" in t}
    assert bool(elementwise_ops) == (elementwise == "triton"), ours


def test_dispatcher_rejects_unknown_compile_policy():
    with pytest.raises(ValueError, match="elementwise_under_compile"):
        dispatch.KernelDispatcher(elementwise_under_compile="cuda")


def test_dispatch_falls_back_where_no_kernel_applies(device):
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16 if device == "cpu" else torch.float64)
    w = torch.ones(8, device=device, dtype=x.dtype)
    assert dispatch.norm(x, w, None, kind="rmsnorm", eps=1e-6) is None  # dtype the kernels do not take here
    assert dispatch.norm(x.float(), w.float(), None, kind="batchnorm", eps=1e-6) is None
    q = torch.randn(1, 2, 8, 24, device=device)
    assert dispatch.attention(q, q, q, causal=True, impl="triton") is None  # head dim 24
    assert dispatch.attention(q, q, q, causal=True, impl="sdpa") is None
    if device == "cpu":
        q = torch.randn(1, 2, 8, 16)
        assert dispatch.attention(q, q, q, causal=True, impl="auto") is None  # CPU: SDPA


def test_dispatch_uses_kernels(close, device):
    x = torch.randn(3, 5, 32, device=device)
    w, b = torch.rand(32, device=device) + 0.5, torch.randn(32, device=device)
    close(dispatch.norm(x, w, b, kind="layernorm", eps=1e-5),
          torch.nn.functional.layer_norm(x, (32,), w, b, 1e-5), 1e-5, 1e-5, "layernorm")
    a, g = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    close(dispatch.mlp_activation(a, g, kind="swiglu"), torch.nn.functional.silu(a) * g, 1e-5, 1e-5, "swiglu")
    close(dispatch.mlp_activation(a, None, kind="gelu"), torch.nn.functional.gelu(a, approximate="tanh"), 1e-5, 1e-5,
          "gelu")
    from lightning_perf.models.gpt import ops
    from lightning_perf.models.gpt.model import rope_cache

    q = torch.randn(2, 3, 7, 16, device=device)
    cos, sin = rope_cache(9, 16, 10000.0, torch.device(device))
    expected = ops.rope(q, cos, sin, impl="torch")
    rotated = dispatch.rope(q, cos, sin)
    assert rotated is not None and rotated.data_ptr() != q.data_ptr()  # never in place (see below)
    close(rotated, expected, 1e-5, 1e-5, "rope")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gpt_kernels_under_activation_checkpointing(mode, close, device):
    """Checkpointed blocks with every kernel give the reference gradients. Selective checkpointing
    keeps the projections' outputs: rotating q / k in place would rotate a kept tensor twice."""
    from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing

    cfg = GPTConfig.from_name("tiny-llama", n_layer=2)
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    tri = GPT(cfg.replace(kernels="triton", attention="triton")).to(device)
    tri.load_state_dict(ref.state_dict())
    apply_activation_checkpointing(list(tri.blocks.values()), mode)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    ref(idx, idx).backward()
    tri(idx, idx).backward()
    for (name, p), q in zip(tri.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, 2e-5, 1e-4, f"grad of {name} ({mode} checkpointing)")


def test_dispatch_leaves_dtensors_to_the_reference_path(device):
    """Tensor-parallel shards (DTensor) never reach a kernel, which would see only the local shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    if not dist.is_available():
        pytest.skip("torch built without distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x = DTensor.from_local(torch.randn(3, 32), mesh, [Replicate()])
        w = DTensor.from_local(torch.ones(32), mesh, [Replicate()])
        assert dispatch.norm(x, w, None, kind="rmsnorm", eps=1e-6) is None
        assert dispatch.mlp_activation(x, x, kind="swiglu") is None
        q = DTensor.from_local(torch.randn(1, 2, 8, 16), mesh, [Replicate()])
        assert dispatch.attention(q, q, q, causal=True, impl="triton") is None
        cos = DTensor.from_local(torch.ones(8, 8), mesh, [Replicate()])
        assert dispatch.rope(q, cos, cos) is None
        head = DTensor.from_local(torch.randn(10, 32), mesh, [Replicate()])
        assert dispatch.lm_loss(x, head, torch.zeros(3, dtype=torch.long)) is None
    finally:
        dist.destroy_process_group()


def test_attention_selector_validates():
    with pytest.raises(ValueError, match="subset"):
        dispatch.AttentionSelector(candidates=("triton", "xformers"))
    with pytest.raises(ValueError, match="subset"):
        dispatch.AttentionSelector(fallback=("fa2",))
    with pytest.raises(ValueError, match="repeat"):
        dispatch.AttentionSelector(repeat=0)


class _FakeBackends(dispatch.AttentionBackends):
    """Backends that are all 'installed' except ``missing``; each call records its name and returns SDPA's result."""

    def __init__(self, missing=()):
        super().__init__()
        self.missing, self.ran = set(missing), []

    def unsupported(self, name, q, k, v):
        return f"{name} is not installed" if name in self.missing else None

    def __call__(self, name, q, k, v, causal):
        self.ran.append(name)
        return dispatch.sdpa(q, k, v, causal)


class _FakeSelector(dispatch.AttentionSelector):
    """Times candidates by a table instead of CUDA events (None: the library raises), on any device."""

    def __init__(self, times, missing=(), **kwargs):
        super().__init__(backends=_FakeBackends(missing), **kwargs)
        self.times, self.timed = times, []

    def can_time(self, q):
        return True

    def _time(self, name, q, k, v, causal):
        self.timed.append(name)
        if self.times.get(name) is None:
            raise RuntimeError(f"{name}: no kernel for this shape")
        return self.times[name]


def _attn_inputs(T=16):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, T, 16, generator=gen), torch.randn(2, 2, T, 16, generator=gen)


def test_auto_picks_the_minimum_of_what_ran_and_caches_per_key():
    times = {"cudnn": 2.0, "flash": 1.5, "efficient": 3.0, "flex": 1.2, "fa3": None, "fa4": 0.4}
    sel = _FakeSelector(times, missing=("fa4",))
    q, k = _attn_inputs()
    assert sel.choose(q, k, k, True) == "flex"  # fa4 would win but is not installed; fa3 raised
    assert sel.timed == ["cudnn", "flash", "efficient", "flex", "fa3"]  # fa4 never timed, triton not a candidate
    key = sel.key(q, k, True)
    assert sel.timings[key] == {"cudnn": 2.0, "flash": 1.5, "efficient": 3.0, "flex": 1.2}
    assert set(sel.skipped[key]) == {"fa3", "fa4"} and "not installed" in sel.skipped[key]["fa4"]
    assert "no kernel for this shape" in sel.skipped[key]["fa3"]
    assert sel.choose(q, k, k, True) == "flex" and len(sel.timed) == 5  # cached: nothing timed again
    sel.times = dict(times, cudnn=0.5)
    q2, k2 = _attn_inputs(T=32)  # a new shape is timed anew, with its own answer
    assert sel.choose(q2, k2, k2, True) == "cudnn" and len(sel.timed) == 10
    assert sel.choose(q, k, k, False) == "cudnn"  # non-causal is another key
    assert sel.choose(q, k, k, True) == "flex"


def test_auto_runs_the_choice_and_sdpa_when_nothing_ran(close):
    sel = _FakeSelector({"efficient": 0.9, "flash": 1.0})
    d = dispatch.KernelDispatcher(attention_selector=sel)
    q, k = _attn_inputs()
    out = d.attention(q, k, k, causal=True, impl="auto")
    assert sel.backends.ran == ["efficient"]
    close(out, dispatch.sdpa(q, k, k, True), 1e-6, 1e-6, "auto")
    none_ran = _FakeSelector({}, fallback=())  # every candidate raises
    assert dispatch.KernelDispatcher(attention_selector=none_ran).attention(q, k, k, impl="auto") is None
    assert none_ran.choices[none_ran.key(q, k, True)] == "sdpa"


def test_triton_is_timed_only_when_every_candidate_refuses():
    q, k = _attn_inputs()
    sel = _FakeSelector({"flash": 5.0, "triton": 1.0})
    assert sel.choose(q, k, k, True) == "flash" and "triton" not in sel.timed  # opt-in, even though faster
    sel = _FakeSelector({"triton": 1.0}, missing=("flex",))
    assert sel.choose(q, k, k, True) == "triton" and sel.timed[-1] == "triton"
    sel = _FakeSelector({"flash": 5.0, "triton": 1.0}, candidates=("flash", "triton"))  # asked to time it
    assert sel.choose(q, k, k, True) == "triton"


def test_auto_under_compile_uses_the_fastest_traceable_choice(monkeypatch):
    """FA4 cannot be traced by Dynamo: a compiled model runs the fastest of the rest, never times."""
    sel = _FakeSelector({"cudnn": 2.0, "flash": 1.5, "flex": 1.2, "fa4": 0.4})
    q, k = _attn_inputs()
    other_q, other_k = _attn_inputs(T=8)
    assert sel.choose(q, k, k, True) == "fa4"
    key = sel.key(q, k, True)
    assert sel.traced_choices[key] == "flex"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    timed = list(sel.timed)
    assert sel.choose(q, k, k, True) == "flex"
    assert sel.choose(other_q, other_k, other_k, True) is None and sel.timed == timed  # uncached: SDPA, untimed
    d = dispatch.KernelDispatcher(attention_selector=sel)
    d.attention(q, k, k, impl="auto")
    assert sel.backends.ran == ["flex"]


def test_auto_choice_traces_into_a_compiled_graph(close):
    """A compiled model whose cached choice is FA4 runs FlexAttention in one graph (``fullgraph=True``
    raises on a break), its block mask built on the way; the output is SDPA's."""
    sel = dispatch.AttentionSelector()
    q, k = _attn_inputs(T=37)
    key = sel.key(q, k, True)
    sel.choices[key], sel.traced_choices[key] = "fa4", "flex"  # as timed on a GPU
    d = dispatch.KernelDispatcher(attention_selector=sel)
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda q, k: d.attention(q, k, k, impl="auto"), backend=backend, fullgraph=True)(q, k)
    close(out, dispatch.sdpa(q, k, k, True), 1e-5, 1e-5, "compiled auto (flex)")
    assert any("flex_attention" in t for t in seen), seen
    assert list(sel.backends._block_masks) == [(37, "cpu")]


def test_attention_by_name_falls_back_to_sdpa_where_it_cannot_run():
    q, k = _attn_inputs()
    d = dispatch.KernelDispatcher()
    for impl in ("flex", "fa3", "fa4", "sdpa"):
        assert d.attention(q, k, k, impl=impl) is None  # CPU: SDPA (no FlexAttention backward on CPU)
    with pytest.raises(ValueError, match="'xformers' is not one of"):
        d.attention(q, k, k, impl="xformers")
    d = dispatch.KernelDispatcher(attention_selector=_FakeSelector({}, missing=("fa3",)))
    q = q.to("meta")  # a device that is not the CPU, so the backends' own checks decide
    assert d.attention(q, k.to("meta"), k.to("meta"), impl="fa3") is None
    assert d.attention(q, k.to("meta"), k.to("meta"), impl="fa4") is not None
    assert d.attention_selector.backends.ran == ["fa4"]


# ---- autotune cache ----------------------------------------------------------------------------


class _FakeTuner(KernelTuner):
    """Times configs by a table instead of CUDA events, on a pretend GPU."""

    def __init__(self, cache, times):
        super().__init__(cache)
        self.times, self.timed = times, []

    def device_name(self, device):
        return "Fake GPU 80GB"

    def _time(self, launch, cfg):
        self.timed.append(cfg["BLOCK"])
        launch(cfg)
        if self.times[cfg["BLOCK"]] is None:
            raise RuntimeError("out of shared memory")
        return self.times[cfg["BLOCK"]]


def test_tuner_picks_fastest_and_second_run_reads_disk(tmp_path):
    configs = [dict(BLOCK=b) for b in (64, 128, 256)]
    times = {64: 2.0, 128: 0.5, 256: None}  # 256 fails to launch: skipped, not fatal
    launched = []
    first = _FakeTuner(AutotuneCache(directory=tmp_path), times)
    cuda = torch.device("cuda")
    best = first.pick("my_kernel", (shape_bucket(1000), torch.bfloat16), configs, launched.append, cuda)
    assert best == dict(BLOCK=128) and first.timed == [64, 128, 256]
    files = list(tmp_path.iterdir())
    # one file per (kernel, GPU, torch and Triton versions); no temp files left behind
    assert [f.name for f in files] == [first.cache.path("my_kernel", "Fake GPU 80GB").name]
    assert files[0].name.startswith("my_kernel--Fake_GPU_80GB--torch-" + torch.__version__.split("+")[0])
    assert software_versions().startswith(f"torch-{torch.__version__}--triton-")
    assert json.loads(files[0].read_text()) == {"1024|torch.bfloat16": {"BLOCK": 128}}
    # a second run (fresh process = fresh tuner) reuses the file and times nothing
    second = _FakeTuner(AutotuneCache(directory=tmp_path), times)
    assert second.pick("my_kernel", (1024, torch.bfloat16), configs, launched.append, cuda) == dict(BLOCK=128)
    assert second.timed == []
    # another key merges into the same file instead of overwriting it
    second.pick("my_kernel", (2048, torch.bfloat16), configs, launched.append, cuda)
    assert set(json.loads(files[0].read_text())) == {"1024|torch.bfloat16", "2048|torch.bfloat16"}


def test_tuner_does_not_time_on_cpu(tmp_path):
    tuner = _FakeTuner(AutotuneCache(directory=tmp_path), {})
    assert tuner.pick("k", (1,), [dict(BLOCK=32), dict(BLOCK=64)], lambda c: None, torch.device("cpu")) == {
        "BLOCK": 32}
    assert tuner.timed == [] and not any(tmp_path.iterdir())


def test_cache_survives_a_corrupt_file(tmp_path):
    cache = AutotuneCache(directory=tmp_path)
    cache.path("k", "gpu").write_text("{not json")
    assert cache.load("k", "gpu", "key") is None
    cache.store("k", "gpu", "key", {"BLOCK": 1})
    assert cache.load("k", "gpu", "key") == {"BLOCK": 1}


def test_shape_bucket():
    assert [shape_bucket(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]


# ---- composition: torch.compile and activation checkpointing -----------------------------------


def _block(x, w, b, q, k, v, head, targets):
    h = layer_norm(x, w, b, 1e-5)
    a = swiglu(h, h * 0.5 + 0.1)
    o = flash_attention(q, k, v, causal=True)
    return fused_linear_cross_entropy(a + o.sum(1, keepdim=True).transpose(1, 2).flatten(2)[..., :a.shape[-1]],
                                      head, targets)


def _block_inputs(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(device, dtype).requires_grad_()

    x, w, b = rnd(2, 16, 16), rnd(16), rnd(16)
    q, k, v = rnd(2, 2, 16, 16), rnd(2, 1, 16, 16), rnd(2, 1, 16, 16)
    head = rnd(40, 16)
    targets = torch.randint(0, 40, (2, 16), generator=gen).to(device)
    return [x, w, b, q, k, v, head], targets


@pytest.mark.gpu(cpu=True)
def test_compile_fullgraph_matches_eager(close, device, model_dtype):
    """Custom ops keep Dynamo from breaking the graph: ``fullgraph=True`` would raise on a break."""
    dtype, f = model_dtype
    inputs, targets = _block_inputs(device, dtype)
    eager = _block(*inputs, targets)
    eager_grads = torch.autograd.grad(eager, inputs)
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)
    out = compiled(*inputs, targets)
    close(out, eager, 1e-5 * f, 1e-5 * f, "compiled loss")
    for i, (g, e) in enumerate(zip(torch.autograd.grad(out, inputs), eager_grads)):
        close(g, e, 1e-5 * f, 1e-5 * f, f"compiled grad {i}")


def test_activation_checkpointing_matches(close, device):
    inputs, targets = _block_inputs(device)
    plain = torch.autograd.grad(_block(*inputs, targets), inputs)
    recomputed = torch.autograd.grad(checkpoint(_block, *inputs, targets, use_reentrant=False), inputs)
    for i, (g, e) in enumerate(zip(recomputed, plain)):
        close(g, e, 1e-6, 1e-6, f"checkpointed grad {i}")


@pytest.mark.gpu
# every candidate adds FlexAttention's compilation (and FA3 / FA4 where installed); the choice and its cache
# are the same code among SDPA's backends
@pytest.mark.parametrize("candidates", [SDPA_BACKENDS, pytest.param(SDPA_BACKENDS + LIBRARY_BACKENDS,
                                                                    marks=pytest.mark.gpu_slow)],
                         ids=["sdpa", "every"])
def test_attention_auto_picks_and_caches_on_gpu(candidates, close):
    selector = dispatch.AttentionSelector(repeat=2, candidates=candidates)
    d = dispatch.KernelDispatcher(attention_selector=selector)
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16)
    out = d.attention(q, k, k, causal=True, impl="auto")
    key = selector.key(q, k, True)
    assert key in selector.choices and selector.timings[key]
    ref = attention_reference(q, k, k, causal=True)
    expected = ref if out is not None else ref
    if out is not None:
        close(out, expected, 2e-2, 2e-2, f"auto ({selector.choices[key]})")


def test_launch_checks_never_touch_kernel_objects():
    """Dynamo cannot take the Python type of a compiled Triton kernel (a GPU-only failure: every
    kernel is interpreted on CPU), so the support checks that run inside traced code compare
    devices against a string decided at import, never the kernel object."""
    import ast
    import inspect
    import pathlib

    from lightning_perf.kernels import _utils

    cpu = torch.zeros(1)
    assert _utils.can_launch("cpu", cpu, None, cpu) and not _utils.can_launch("cuda", cpu)
    assert not _utils.can_launch("cpu", cpu, torch.zeros(1, device="meta"))  # mixed devices
    root = pathlib.Path(inspect.getfile(_utils)).parent
    calls = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "can_launch":
                calls.append((path.name, node.args[0]))
    assert len(calls) >= 8
    for name, first in calls:  # a module constant computed by launch_device at import
        assert isinstance(first, ast.Name) and first.id.endswith("_DEVICE"), (name, ast.dump(first))
