"""Imports run downward only: each layer of the package imports nothing of the layers above it,
and no two modules of the package import each other, directly or through others.

Every module is parsed (not imported), and every ``import`` statement counts, including those
inside functions and under ``TYPE_CHECKING``, so a lazy import cannot hide an upward dependency
or a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_perf

PACKAGE = "lightning_perf"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
ADAPTERS = ("strategies", "plugins", "callbacks", "cli")

# layer -> (subpackages of the pack it must not import, whether it must not import Lightning);
# the bare package counts as a forbidden import everywhere (its __init__ imports the strategies)
FORBIDDEN: dict[str, tuple[tuple[str, ...], bool]] = {
    "parallel": (("models",) + ADAPTERS, True),
    "perf": (("models",) + ADAPTERS, True),
    "kernels": (("data", "models", "parallel", "perf") + ADAPTERS, True),
    "data": (("kernels", "models", "parallel", "perf") + ADAPTERS, False),
    "runtime": (("models",) + ADAPTERS, False),
    "models": (ADAPTERS, False),
    # the callbacks work with any LightningModule and any strategy: they ask them (``perf_settings()``)
    "callbacks": (("models", "strategies", "cli"), False),
}


def _imports(path: Path, module: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute module name, names taken from it) of every import in the file, relative
    imports resolved (``import a.b`` takes nothing by name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name, tuple(alias.name for alias in node.names)))
    return found


def _imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative imports resolved."""
    found = []
    for line, name, names in _imports(path, module):
        if name == PACKAGE and names:  # ``from lightning_perf import models`` imports the subpackage
            found += [(line, f"{name}.{alias}") for alias in names]
        else:
            found.append((line, name))
    return found


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package under ``root`` (a package by its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join((PACKAGE, *path.relative_to(root).with_suffix("").parts))
        out[module.removesuffix(".__init__")] = path
    return out


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` between the package's modules.

    ``from a.b import c`` is an import of the module ``a.b.c`` when there is one, else of ``a.b``; an
    import of a name the package has no module for counts for the closest enclosing module.
    """
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for line, name, names in _imports(path, module):
            if name.split(".")[0] != PACKAGE:
                continue
            targets = [f"{name}.{n}" for n in names if f"{name}.{n}" in modules] if names else []
            if not targets or len(targets) < len(names):  # some names are attributes of ``name`` itself
                targets.append(name)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.setdefault(target, line)
        graph[module] = edges
    return graph


def import_cycles(root: Path) -> list[str]:
    """One line per cycle of imports between the package's modules: ``a:3 -> b:7 -> a``."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        members = set(component)
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats: one concrete cycle
            here = path[-1]
            nxt = min(w for w in graph[here] if w in members)
            if nxt in seen:
                cycle = path[path.index(nxt):] + [nxt]
                break
            path.append(nxt)
            seen.add(nxt)
        steps = [f"{a}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
        out.append(" -> ".join(steps + [cycle[-1]]))
    return sorted(out)


def layer_violations(root: Path) -> list[str]:
    """``file:line: layer imports name`` for every upward import under the package directory ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        layer = rel.parts[0] if len(rel.parts) > 1 else None
        if layer not in FORBIDDEN:
            continue
        module = ".".join((PACKAGE, *rel.with_suffix("").parts))
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        banned_subpackages, no_lightning = FORBIDDEN[layer]
        for line, name in _imported_modules(path, module):
            parts = name.split(".")
            if parts[0] == PACKAGE:
                bad = len(parts) == 1 or parts[1] in banned_subpackages
            else:
                bad = no_lightning and parts[0] in LIGHTNING
            if bad:
                out.append(f"{rel}:{line}: {layer} imports {name}")
    return out


def test_layers_import_downward_only() -> None:
    root = Path(lightning_perf.__file__).parent
    assert layer_violations(root) == []


def test_no_import_cycles() -> None:
    root = Path(lightning_perf.__file__).parent
    assert import_cycles(root) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [p for p in path.relative_to(root).parents if str(p) != "."]:
            (root / parent / "__init__.py").touch()
        path.write_text(source)
    (root / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # two modules, one of them importing the other inside a function
        ({"perf/a.py": "from lightning_perf.perf.b import g\n",
          "perf/b.py": "def g():\n    from lightning_perf.perf import a\n"},
         ["lightning_perf.perf.a:1 -> lightning_perf.perf.b:2 -> lightning_perf.perf.a"]),
        # an import for type checking only, relative, through a third module
        ({"parallel/a.py": "from .b import x\n",
          "parallel/b.py": "from .c import y\n",
          "parallel/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import z\n"},
         ["lightning_perf.parallel.a:1 -> lightning_perf.parallel.b:1 -> lightning_perf.parallel.c:3 -> "
          "lightning_perf.parallel.a"]),
        # a package whose __init__ re-exports a module that imports a name from the package
        ({"models/__init__.py": "from lightning_perf.models.m import M\n",
          "models/m.py": "from lightning_perf.models import helper\nclass M: ...\n",
          "models/helper.py": "from lightning_perf.models import M\n"},
         ["lightning_perf.models:1 -> lightning_perf.models.m:1 -> lightning_perf.models.helper:1 -> "
          "lightning_perf.models"]),
    ],
)
def test_cycle_check_finds_a_planted_cycle(tmp_path: Path, files: dict[str, str], expected: list[str]) -> None:
    assert import_cycles(_package(tmp_path, files)) == expected


def test_cycle_check_passes_imports_of_submodules_through_their_package(tmp_path: Path) -> None:
    # the package's __init__ re-exports its modules, which import each other by ``from package import module``
    root = _package(tmp_path, {
        "perf/__init__.py": "from lightning_perf.perf.a import A\nfrom lightning_perf.perf.b import B\n",
        "perf/a.py": "from lightning_perf.perf import b\nA = 1\n",
        "perf/b.py": "B = 2\n",
    })
    assert import_cycles(root) == []


@pytest.mark.parametrize(
    ("file", "source", "expected"),
    [
        ("parallel/x.py", "def f():\n    from lightning_perf.models.gpt import GPT\n",
         "parallel imports lightning_perf.models.gpt"),
        ("parallel/x.py", "import lightning.pytorch as pl\n", "parallel imports lightning.pytorch"),
        ("perf/x.py", "from ..callbacks import mfu\n", "perf imports lightning_perf.callbacks"),
        ("kernels/ops/x.py", "from lightning_perf.parallel.sharding.fsdp import find_blocks\n",
         "kernels imports lightning_perf.parallel.sharding.fsdp"),
        ("kernels/x.py", "from lightning_perf import parallel\n", "kernels imports lightning_perf.parallel"),
        ("data/x.py", "import lightning_perf\n", "data imports lightning_perf"),
        ("models/gpt/x.py", "from ...strategies import ZeroStrategy\n", "models imports lightning_perf.strategies"),
        ("callbacks/x.py", "def f():\n    from lightning_perf.models.gpt.module import GPTLightningModule\n",
         "callbacks imports lightning_perf.models.gpt.module"),
        ("callbacks/x.py", "from ..strategies.zero import ZeroStrategy\n",
         "callbacks imports lightning_perf.strategies.zero"),
    ],
)
def test_layer_check_finds_a_planted_violation(tmp_path: Path, file: str, source: str, expected: str) -> None:
    path = tmp_path / file
    path.parent.mkdir(parents=True)
    path.write_text(source)
    (tmp_path / "perf").mkdir(exist_ok=True)
    (tmp_path / "perf" / "ok.py").write_text('"""Strings may name callbacks."""\nfrom lightning_perf.perf import flops\n')
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "models" / "ok.py").write_text("from lightning_perf.parallel.compute.compile import apply_compile\n")
    found = layer_violations(tmp_path)
    assert len(found) == 1 and found[0].endswith(expected), found
