"""Imports run downward only: each layer of the package imports nothing of the layers above it.

Every module is parsed (not imported), and every ``import`` statement counts, including those
inside functions, so a lazy import cannot hide an upward dependency.
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
}


def _imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == PACKAGE:  # ``from lightning_perf import models`` imports the subpackage
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, name))
    return found


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


@pytest.mark.parametrize(
    ("file", "source", "expected"),
    [
        ("parallel/x.py", "def f():\n    from lightning_perf.models.gpt import GPT\n",
         "parallel imports lightning_perf.models.gpt"),
        ("parallel/x.py", "import lightning.pytorch as pl\n", "parallel imports lightning.pytorch"),
        ("perf/x.py", "from ..callbacks import mfu\n", "perf imports lightning_perf.callbacks"),
        ("kernels/ops/x.py", "from lightning_perf.parallel.fsdp import find_blocks\n",
         "kernels imports lightning_perf.parallel.fsdp"),
        ("kernels/x.py", "from lightning_perf import parallel\n", "kernels imports lightning_perf.parallel"),
        ("data/x.py", "import lightning_perf\n", "data imports lightning_perf"),
        ("models/gpt/x.py", "from ...strategies import ZeroStrategy\n", "models imports lightning_perf.strategies"),
    ],
)
def test_layer_check_finds_a_planted_violation(tmp_path: Path, file: str, source: str, expected: str) -> None:
    path = tmp_path / file
    path.parent.mkdir(parents=True)
    path.write_text(source)
    (tmp_path / "perf").mkdir(exist_ok=True)
    (tmp_path / "perf" / "ok.py").write_text('"""Strings may name callbacks."""\nfrom lightning_perf.perf import flops\n')
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "models" / "ok.py").write_text("from lightning_perf.parallel.compile import apply_compile\n")
    found = layer_violations(tmp_path)
    assert len(found) == 1 and found[0].endswith(expected), found
