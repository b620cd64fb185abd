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
