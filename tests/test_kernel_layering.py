"""Kernel modules are leaves: ``sparsehi/kernels`` imports nothing of ``sparsehi`` outside
itself, ``hicache/kernels`` nothing of ``sparsehi`` at all; both may use
``hicache.triton_support`` (where a kernel runs) and their sibling kernel modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "sparsehi/kernels": ("sparsehi.kernels.", "hicache.kernels.", "hicache.triton_support"),
    "hicache/kernels": ("hicache.kernels.", "hicache.triton_support"),
}


def _project_imports(path: Path) -> list[tuple[int, str]]:
    """Every ``sparsehi`` / ``hicache`` module a file imports, anywhere in it (also inside
    functions and ``if TYPE_CHECKING:`` blocks)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["<relative import>"]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in ("sparsehi", "hicache", "<relative import>")]
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_kernel_modules_import_only_kernels_and_triton_support(package):
    files = sorted((ROOT / package).glob("*.py"))
    assert len(files) > 2, files
    bad = [f"{f.relative_to(ROOT)}:{line} imports {name}" for f in files for line, name in _project_imports(f)
           if not name.startswith(ALLOWED[package])]
    assert not bad, "\n".join(bad)
