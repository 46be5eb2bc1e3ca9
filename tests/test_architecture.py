"""The package structure docs/architecture.md describes: imports go one way (no cycle, no
module importing a layer above its own), the coordinator is the only door to the sparse
state, and modules and functions stay readable in size. Static (reads the source, imports
nothing), so it runs in a second."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hicache", "sparsehi")

# Lowest first; a module may import its own layer and the layers below. The first prefix
# that matches a module names its layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("tiering", ("hicache",)),
    ("kernels", ("sparsehi.kernels",)),
    ("data", ("sparsehi.config", "sparsehi.selection", "sparsehi.forward_batch", "sparsehi.request_table",
              "sparsehi.page_tables", "sparsehi.lru_buffer", "sparsehi.swap_in_stats", "sparsehi.row_choice",
              "sparsehi.input_checks")),
    ("policies", ("sparsehi.algorithms", "sparsehi.adapters")),
    ("sparse state", ("sparsehi.fp8_pages", "sparsehi.prefill", "sparsehi.kv_manager", "sparsehi.decode")),
    ("door", ("sparsehi.coordinator",)),
    ("engines", ("sparsehi.runtime", "sparsehi.sglang_plugin", "sparsehi.cli", "sparsehi.__main__")),
]
# Within the policies layer: algorithms decide what to attend, adapters how attention reads
# it; neither knows the other.
APART = [("sparsehi.adapters", "sparsehi.algorithms"), ("sparsehi.algorithms", "sparsehi.adapters")]

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# Every Python file of these trees (tests aside) is held to the size limits.
SIZED_TREES = ("hicache", "sparsehi", "benchmarks", "scripts")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module ``name`` refers to (a module, or the package holding a name)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path) -> set[str]:
    """Project modules ``mod`` imports, at any depth of its code, except under
    ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for n in names:
            target = _resolve(n)
            if target is not None and target != mod:
                out.add(target)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Each module's project imports; parsed when a test asks (about 4 s), not when the
    module is collected, which every test process does."""
    return {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(mod: str) -> int:
    if mod == "sparsehi":
        return 0  # the package's __init__ (a docstring and a version)
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{mod} is in no layer of tests/test_architecture.py: add it to LAYERS")


def test_every_module_has_a_layer():
    for mod in MODULES:
        _layer(mod)


def test_no_import_cycle(graph):
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_go_down_the_layers(graph):
    bad = [f"{m} ({LAYERS[_layer(m)][0]}) imports {n} ({LAYERS[_layer(n)][0]})"
           for m, deps in graph.items() for n in deps if _layer(n) > _layer(m)]
    bad += [f"{m} imports {n}" for m, deps in graph.items() for n in deps for a, b in APART
            if (m == a or m.startswith(a + ".")) and (n == b or n.startswith(b + "."))]
    assert not bad, "\n".join(sorted(bad))


def test_hicache_and_kernels_import_nothing_of_the_sparse_layers_above(graph):
    for m, deps in graph.items():
        if m.startswith("hicache"):
            assert not [n for n in deps if n.startswith("sparsehi")], m
        if m.startswith("sparsehi.kernels"):
            assert all(n.startswith(("hicache", "sparsehi.kernels")) for n in deps), (m, deps)


def test_the_coordinator_is_the_only_door_to_the_sparse_state():
    """Engines (the runtime, the SGLang plugin, the benchmarks) reach the KV manager and the
    decode path only through SparseCoordinator's methods."""
    offenders = []
    for path in [*(ROOT / "sparsehi" / "runtime").rglob("*.py"), *(ROOT / "sparsehi" / "sglang_plugin").rglob("*.py"),
                 *(ROOT / "scripts").rglob("*.py")]:
        text = path.read_text()
        for needle in ("coord.manager", "coord.kv.", "coord.decoder.", "from sparsehi.kv_manager",
                       "from sparsehi.decode"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders


def _long_functions(path: Path) -> list[str]:
    """Functions of ``path`` over MAX_FUNCTION_LINES, except Triton/Gluon kernels (any
    decorator naming ``jit``) and a benchmark's ``main`` (its whole command line in one place)."""
    tree = ast.parse(path.read_text())
    in_benchmarks = path.relative_to(ROOT).parts[0] == "benchmarks"
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any("jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        if in_benchmarks and node.name == "main":
            continue
        n = node.end_lineno - node.lineno + 1
        if n > MAX_FUNCTION_LINES:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


@pytest.mark.parametrize("rel", ["sparsehi/coordinator.py", "sparsehi/kv_manager.py", "sparsehi/decode/decoder.py",
                                 "sparsehi/decode/state.py", "sparsehi/prefill.py", "sparsehi/page_tables.py",
                                 "sparsehi/request_table.py", "sparsehi/runtime/sparse_mode.py",
                                 "sparsehi/runtime/runner.py", "sparsehi/runtime/runtime_mode.py"])
def test_decode_path_modules_are_short(rel):
    path = ROOT / rel
    assert len(path.read_text().splitlines()) <= MAX_FILE_LINES, rel
    assert not _long_functions(path)


def _sized_files() -> list[Path]:
    return sorted(p for tree in SIZED_TREES for p in (ROOT / tree).rglob("*.py"))


def test_no_module_outside_tests_is_long():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _sized_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def test_no_function_outside_tests_is_long():
    long = [f for p in _sized_files() for f in _long_functions(p)]
    assert not long, "\n".join(long)
