"""The GPU run is ``pytest -m gpu``: every test that puts work on CUDA carries the ``gpu`` marker, "on a GPU"
is decided in one place (``tests/_gpu.py``), and ``tests/conftest.py`` skips GPU-only tests on a machine
without CUDA while ``gpu(cpu=True)`` tests run there too.

The first two tests read the source of every test module (no imports, so they take well under a second):
a test function uses CUDA when its body passes ``device="cuda"`` (or ``torch.device("cuda", ...)``) to a
``torch.*`` / ``nn.*`` call, to ``.to`` or to a helper defined in its own module, ``accelerator="gpu"`` to a
Trainer, calls ``.cuda()`` / ``.to("cuda")`` / ``torch.autocast("cuda")``, or hands ``"cuda"`` to a helper of
its module. A test that does is GPU-only: it carries a plain
``@pytest.mark.gpu``; one that carries it must do so."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _gpu import SKIP_REASON, apply_gpu_marker

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
CUDA = ("cuda", "gpu")


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(TESTS.rglob("test_*.py"))]


def _is_cuda(node: ast.AST) -> bool:
    """``"cuda"``, ``"cuda:N"`` or ``torch.device("cuda", ...)``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cuda"
    return (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device" and bool(node.args)
            and _is_cuda(node.args[0]))


def _uses_cuda(fn: ast.FunctionDef, helpers: set[str]) -> list[str]:
    """Where ``fn`` puts work on CUDA (see the module docstring), as source snippets."""
    found = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        places = func.startswith(("torch.", "nn.")) or func.endswith(".to") or func in helpers
        hit = places and any(k.arg == "device" and _is_cuda(k.value) for k in node.keywords)
        hit |= func.lower().endswith("trainer") and any(
            k.arg == "accelerator" and isinstance(k.value, ast.Constant) and k.value.value in CUDA
            for k in node.keywords)
        hit |= isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and not node.args
        hit |= (func.endswith(".to") or func == "torch.autocast" or func in helpers) and any(
            _is_cuda(a) for a in node.args)
        if hit:
            found.append(ast.unparse(node)[:100])
    return found


def _marks(decorators: list[ast.expr]) -> list[ast.expr]:
    return [d for d in decorators if ast.unparse(d.func if isinstance(d, ast.Call) else d) == "pytest.mark.gpu"]


def _tests(module: ast.Module):
    """(test function, its gpu marks) for every test, in classes too, the module's ``pytestmark`` included."""
    module_marks = [m for node in module.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
                    for m in _marks(node.value.elts if isinstance(node.value, (ast.List, ast.Tuple))
                                    else [node.value])]
    for node in module.body:
        inner = [(node, [])] if isinstance(node, ast.FunctionDef) else \
            [(f, _marks(node.decorator_list)) for f in node.body if isinstance(f, ast.FunctionDef)] \
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test") else []
        for fn, class_marks in inner:
            if fn.name.startswith("test"):
                yield fn, module_marks + class_marks + _marks(fn.decorator_list)


def _gpu_only(marks: list[ast.expr]) -> bool:
    return any(not (isinstance(m, ast.Call) and any(k.arg == "cpu" for k in m.keywords)) for m in marks)


def test_every_test_that_uses_cuda_is_gpu_only_and_marked_and_no_other_is():
    unmarked, needless, gpu_only = [], [], set()
    for path, module in _modules():
        helpers = {f.name for f in module.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("test")}
        for fn, marks in _tests(module):
            name = f"{path.relative_to(TESTS)}::{fn.name}"
            uses = _uses_cuda(fn, helpers)
            if uses:
                gpu_only.add(name)
            if uses and not _gpu_only(marks):
                unmarked.append(f"{name}: {uses[0]}")
            if _gpu_only(marks) and not uses:
                needless.append(name)
    assert not unmarked, "tests that use CUDA without @pytest.mark.gpu (the GPU run would miss them):\n" + \
        "\n".join(unmarked)
    assert not needless, "tests marked GPU-only that put nothing on CUDA (use gpu(cpu=True) if they run on " \
        "the CPU too):\n" + "\n".join(needless)
    # the scan sees GPU-only tests in every folder that has them
    for known in ("kernels/test_flash_attention.py::test_flash_attention_gpu",
                  "kernels/test_fp8_linear.py::test_cast_transpose_kernel_bitwise_on_gpu",
                  "callbacks/test_callbacks_memory.py::test_cuda_peaks_and_snapshot",
                  "plugins/test_precision.py::test_clip_fold_on_cuda_equals_clip_then_step"):
        assert known in gpu_only, known


def test_on_a_gpu_is_decided_in_one_place_and_no_test_skips_itself_for_lack_of_one():
    decided, own_skips = [], []
    for path in [*sorted(TESTS.rglob("*.py"))]:
        if path.name == "_gpu.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.is_available":
                decided.append(f"{path.relative_to(TESTS)}:{node.lineno}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.skipif" and any(
                    w in ast.unparse(node) for w in ("ON_GPU", "cuda")):
                own_skips.append(f"{path.relative_to(TESTS)}:{node.lineno}")
            if isinstance(node, ast.If) and ast.unparse(node.test).replace(" ", "") in ("notON_GPU",) and any(
                    isinstance(s, ast.Expr) and "pytest.skip" in ast.unparse(s) for s in node.body):
                own_skips.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not decided, "use ON_GPU from tests/_gpu.py: " + ", ".join(decided)
    assert not own_skips, "mark GPU-only tests with @pytest.mark.gpu instead of skipping them: " + ", ".join(own_skips)


SAMPLE = """
import pytest


@pytest.mark.gpu
def test_gpu_only():
    pass


@pytest.mark.gpu(cpu=True)
def test_gpu_path_also_on_cpu():
    pass


def test_cpu_only():
    pass
"""


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu-machine", "gpu-machine"])
def test_the_gpu_run_selects_the_marked_tests_and_skips_gpu_only_ones_without_cuda(pytester, on_gpu):
    pytester.makeini("[pytest]\nmarkers =\n    gpu: the GPU run\n")
    pytester.makeconftest(f"from _gpu import apply_gpu_marker\n\n\n"
                          f"def pytest_collection_modifyitems(config, items):\n"
                          f"    apply_gpu_marker(items, on_gpu={on_gpu})\n")
    pytester.makepyfile(test_sample=SAMPLE)
    result = pytester.runpytest("-m", "gpu", "-rs", "-p", "no:cacheprovider")
    if on_gpu:
        result.assert_outcomes(passed=2, deselected=1)
    else:
        result.assert_outcomes(passed=1, skipped=1, deselected=1)
        result.stdout.fnmatch_lines([f"*test_sample.py:*{SKIP_REASON}*"])
    everything = pytester.runpytest("-p", "no:cacheprovider")
    everything.assert_outcomes(passed=3 if on_gpu else 2, skipped=0 if on_gpu else 1)


def test_a_gpu_marker_with_other_arguments_is_refused(pytester):
    pytester.makepyfile(test_bad="import pytest\n\n\n@pytest.mark.gpu(cpus=True)\ndef test_x():\n    pass\n")
    items = pytester.getitems(pytester.path / "test_bad.py")
    with pytest.raises(pytest.UsageError, match="takes only cpu=True"):
        apply_gpu_marker(items, on_gpu=False)


GPU_CONFTEST = """
import pytest
from _gpu import add_gpu_options, select_gpu_items


def pytest_addoption(parser):
    add_gpu_options(parser)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    select_gpu_items(config, items, on_gpu={on_gpu}, gpu_count={gpus})
"""

SLOW_SAMPLE = """
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.gpu_slow)])
def test_gpu_case(n):
    pass


@pytest.mark.gpu(cpu=True)
@pytest.mark.gpu_slow
def test_slow_on_a_gpu_only():
    pass


@pytest.mark.gpu(gpus=2)
def test_two_gpus():
    pass
"""


def _gpu_pytester(pytester, on_gpu, gpus, sample=SLOW_SAMPLE):
    pytester.makeini("[pytest]\nmarkers =\n    gpu: the GPU run\n    gpu_slow: slow on a GPU\n")
    pytester.makeconftest(GPU_CONFTEST.format(on_gpu=on_gpu, gpus=gpus))
    pytester.makepyfile(test_sample=sample)


@pytest.mark.parametrize("on_gpu,gpus,slow,outcomes", [
    (False, 0, False, dict(passed=1, skipped=3)),  # gpu_slow changes nothing without CUDA
    (False, 0, True, dict(passed=1, skipped=3)),
    (True, 1, False, dict(passed=1, skipped=3)),  # the slow cases and the two-GPU test skipped
    (True, 1, True, dict(passed=3, skipped=1)),
    (True, 2, False, dict(passed=2, skipped=2)),
], ids=["cpu", "cpu-slow-option", "one-gpu", "one-gpu-slow", "two-gpus"])
def test_gpu_slow_cases_and_multi_gpu_tests_are_skipped_with_their_reasons(pytester, on_gpu, gpus, slow, outcomes):
    _gpu_pytester(pytester, on_gpu, gpus)
    result = pytester.runpytest("-m", "gpu", "-rs", "-p", "no:cacheprovider", *(["--gpu-slow"] if slow else []))
    result.assert_outcomes(**outcomes)
    if on_gpu and not slow:
        result.stdout.fnmatch_lines(["*test_sample.py:*gpu_slow: a faster case checks the same*--gpu-slow*"])
    if on_gpu and gpus == 1:
        result.stdout.fnmatch_lines(["*needs 2 GPUs, 1 visible*"])


def test_gpu_slow_without_a_gpu_marker_and_bad_gpu_counts_are_refused(pytester):
    pytester.makepyfile(test_bad="import pytest\n\n\n@pytest.mark.gpu_slow\ndef test_a():\n    pass\n\n\n"
                                 "@pytest.mark.gpu(gpus=0)\ndef test_b():\n    pass\n\n\n"
                                 "@pytest.mark.gpu(cpu=True, gpus=2)\ndef test_c():\n    pass\n")
    a, b, c = pytester.getitems(pytester.path / "test_bad.py")
    for item, message in ((a, "add @pytest.mark.gpu"), (b, "device count >= 1"), (c, "drop cpu=True")):
        with pytest.raises(pytest.UsageError, match=message):
            apply_gpu_marker([item], on_gpu=True, gpu_count=1)


SHARD_SAMPLE = """
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("n", range(5))
def test_five(n):
    pass


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.gpu_slow),
                               pytest.param(3, marks=pytest.mark.gpu_slow)])
def test_one_runs(n):
    pass


@pytest.mark.gpu
def test_a():
    pass


@pytest.mark.gpu
@pytest.mark.parametrize("n", range(3))
def test_three(n):
    pass


def test_not_gpu():
    pass
"""


def test_shards_deal_the_selected_tests_round_robin_and_cover_them_once(pytester):
    _gpu_pytester(pytester, True, 1, SHARD_SAMPLE)
    ran = []
    for index in range(3):
        result = pytester.runpytest("-m", "gpu", "-v", "-p", "no:cacheprovider", f"--gpu-shard={index}/3")
        ran.append([line.split(" ")[0].split("::")[1] for line in result.outlines
                    if "::test_" in line and ("PASSED" in line or "SKIPPED" in line)])
    # the ten cases that run are dealt in collection order (0, 3, 6, 9 to shard 0, ...), then the two skipped ones
    assert ran == [["test_five[0]", "test_five[3]", "test_one_runs[2]", "test_a", "test_three[2]"],
                   ["test_five[1]", "test_five[4]", "test_one_runs[3]", "test_three[0]"],
                   ["test_five[2]", "test_one_runs[1]", "test_three[1]"]], ran
    result = pytester.runpytest("-m", "gpu", "-p", "no:cacheprovider", "--gpu-shard=3/3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpu-shard 3/3: I must be in 0..N-1*"])


def test_first_config_tuner_takes_the_first_config_that_launches_and_launches_it_again():
    import torch

    from _gpu import FirstConfigTuner

    launched = []

    def launch(cfg):
        launched.append(cfg["B"])
        if cfg["B"] == 1:
            raise RuntimeError("out of resources")

    tuner = FirstConfigTuner()
    configs = [dict(B=1), dict(B=2), dict(B=3)]
    assert tuner.pick("k", (16,), configs, launch, torch.device("cuda", 0)) == dict(B=2)
    assert launched == [1, 2]
    assert tuner.pick("k", (16,), configs, launch, torch.device("cuda", 0)) == dict(B=2) and launched == [1, 2]
    assert tuner.pick("k", (32,), [dict(B=4)], launch, torch.device("cuda", 0)) == dict(B=4) and launched == [1, 2]
    with pytest.raises(RuntimeError, match="every launch configuration of k failed"):
        tuner.pick("k", (64,), [dict(B=1), dict(B=1)], launch, torch.device("cuda", 0))
