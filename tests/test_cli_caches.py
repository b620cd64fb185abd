"""Where the ``lightning-perf`` command keeps compiled kernels and tuning results (``lightning_perf.cli.caches``):
the folders it picks (variables already set win), that the command sets them for itself and the
processes it starts while an in-process caller's environment stays as it was, and that a graph with
an autograd ``Function`` and an autocast region (what the FP8 linears trace to) compiled by one process
is read back from AOTAutograd's cache by the next."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_perf.cli import main
from lightning_perf.cli.caches import cache_dirs

ROOT = Path(__file__).resolve().parents[1]


def test_cache_dirs_follow_the_variables_already_set(tmp_path):
    home = cache_dirs({"HOME": str(tmp_path)})
    assert home.root == tmp_path / ".cache" / "lightning_perf"
    assert (home.inductor, home.triton) == (home.root / "inductor", home.root / "triton")
    assert (home.autotune, home.attention) == (home.root / "autotune", home.root / "attention")
    assert cache_dirs({"HOME": "/h", "XDG_CACHE_HOME": str(tmp_path)}).root == tmp_path / "lightning_perf"
    chosen = cache_dirs({"HOME": "/h", "XDG_CACHE_HOME": "/x", "LIGHTNING_PERF_CACHE_DIR": str(tmp_path / "lp"),
                         "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"), "TRITON_CACHE_DIR": str(tmp_path / "tri")})
    assert chosen.root == tmp_path / "lp" and chosen.autotune == tmp_path / "lp" / "autotune"
    assert (chosen.inductor, chosen.triton) == (tmp_path / "ind", tmp_path / "tri")
    # torch writes its own default into the environment when torch._dynamo is imported: not a choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert cache_dirs({"HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}).inductor == (
        home.root / "inductor")


def _python(code: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return dict(env, PYTHONPATH=str(ROOT), **extra)


def test_the_command_sets_its_caches(tmp_path):
    got = _python('''
        import json, os
        from lightning_perf.cli import main
        from lightning_perf.kernels import autotune, dispatch
        import torch._functorch.config as fc
        main(["--help"], command=True)
        selector = dispatch.default_dispatcher().attention_selector
        print(json.dumps({"inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                          "triton": os.environ.get("TRITON_CACHE_DIR"),
                          "autotune": str(autotune.default_tuner().cache.directory),
                          "attention": str(selector.cache.directory),
                          "custom_functions": fc.autograd_cache_allow_custom_autograd_functions}))
    ''', _env(LIGHTNING_PERF_CACHE_DIR=str(tmp_path / "lp"), TRITON_CACHE_DIR=str(tmp_path / "mine")))
    assert got["inductor"] == str(tmp_path / "lp" / "inductor")
    assert got["triton"] == str(tmp_path / "mine")  # already set: kept
    assert got["autotune"] == str(tmp_path / "lp" / "autotune")
    assert got["attention"] == str(tmp_path / "lp" / "attention")
    assert got["custom_functions"] is True


def test_an_in_process_call_keeps_the_callers_environment(monkeypatch, capsys):
    from lightning_perf.kernels import dispatch

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    dispatcher = dispatch.default_dispatcher()
    main(["--help"])
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and dispatch.default_dispatcher() is dispatcher
    assert "Subcommands" in capsys.readouterr().out


_COMPILE_FP8_LIKE = '''
    import json, os, torch
    from torch._dynamo.utils import counters
    from lightning_perf.cli.caches import cache_dirs, use_cache_dirs

    use_cache_dirs(cache_dirs(os.environ), environ=os.environ)

    class Scaled(torch.autograd.Function):  # the shape of the FP8 matmuls: a Function inside an autocast region
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w * 2.0

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t() * 2.0, x.t() @ g * 2.0

    def f(x, w):
        with torch.autocast("cpu", enabled=False):
            return Scaled.apply(x, w).relu().sum()

    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    torch.compile(f)(x, w).backward()
    aot = counters["aot_autograd"]
    print(json.dumps({k: aot.get(k, 0) for k in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
                     | {"grad": x.grad.sum().item()}))
'''


@pytest.mark.skipif(sys.platform == "win32", reason="Inductor's CPU code generation")
def test_a_graph_with_a_function_and_an_autocast_region_is_cached_across_processes(tmp_path):
    env = _env(LIGHTNING_PERF_CACHE_DIR=str(tmp_path))
    first = _python(_COMPILE_FP8_LIKE, env)
    assert first["autograd_cache_miss"] == 1 and first["autograd_cache_bypass"] == 0
    second = _python(_COMPILE_FP8_LIKE, env)
    assert second["autograd_cache_hit"] == 1 and second["autograd_cache_bypass"] == 0
    assert second["grad"] == first["grad"]
    # without the pack's switches this torch bypasses AOTAutograd's cache for such a graph
    plain = _python(_COMPILE_FP8_LIKE.replace("use_cache_dirs(cache_dirs(os.environ), environ=os.environ)",
                                              "os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.environ['PLAIN']"),
                    dict(env, PLAIN=str(tmp_path / "plain")))
    assert plain["autograd_cache_bypass"] == 1
