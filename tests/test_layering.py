"""The layout shows the architecture (docs/architecture.md): each folder imports only the folders below it,
low layers stand alone, and every module is short enough to hold in mind.

The import graph is read from the source with `ast` (function-local imports included), not from
what happens to be loaded; the low layers are imported in a fresh interpreter where the package's
`__init__.py` does not run, so only what they themselves import gets loaded.
"""

import ast
import os

import pytest
from fresh import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("qtensor", "qtensor_kernels")
MAX_LINES = 500


def module_files() -> dict[str, str]:
    """Every module of the packages by dotted name (a package by its own name) -> its file."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for file in files:
                if not file.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, file), ROOT)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = os.path.join(folder, file)
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement names before `import`."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    package = parts if is_package else parts[:-1]  # a package's own `from . import` is relative to itself
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def import_edges(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its file. `from A import n` is an edge
    to `A.n` where that is a module, else to `A`; `import A.B` is an edge to `A.B`."""
    edges = {}
    for module, path in modules.items():
        is_package = os.path.basename(path) == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, is_package, node)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for name in names:
                # `import qtensor.formats.float8.something_else` is not a module: take the longest module prefix
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    targets.add(name)
        targets.discard(module)
        edges[module] = targets
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_import_graph_reader_sees_relative_absolute_and_function_local_imports(tmp_path):
    """The reader itself, on a made-up package: otherwise a graph it misread would pass as acyclic."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from .sub import b\nimport pkg.sub.c\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (package / "sub" / "c.py").write_text("def f():\n    from ..a import something\n    from pkg import d\n")
    (package / "d.py").write_text("def f():\n    import pkg\n")
    files = {
        "pkg": str(package / "__init__.py"), "pkg.a": str(package / "a.py"), "pkg.sub": str(package / "sub" / "__init__.py"),
        "pkg.sub.b": str(package / "sub" / "b.py"), "pkg.sub.c": str(package / "sub" / "c.py"), "pkg.d": str(package / "d.py"),
    }
    edges = import_edges(files)
    assert edges == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b", "pkg.sub.c"}, "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a"}, "pkg.sub.c": {"pkg.a", "pkg.d"}, "pkg.d": {"pkg"},
    }
    assert find_cycle(edges) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    modules = module_files()
    edges = import_edges(modules)
    assert edges.get("qtensor") and sum(map(len, edges.values())) > len(edges)  # the reader found the imports
    # The package is the top: it may import every module, so an edge back into it is a cycle.
    edges["qtensor"] = edges["qtensor"] | {m for m in modules if m.startswith("qtensor.")}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + "; modules on cycles: " + str(tangled(edges))


def tangled(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach one another (each group holds a cycle), for the message."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for target in edges.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    reached = {node: reach(node) for node in edges}
    groups = {frozenset(n for n in reached[node] if node in reached.get(n, ())) for node in edges if node in reached[node]}
    return sorted(sorted(group) for group in groups)


# Each folder and the folders its modules may import (docs/architecture.md). A module of the model
# level (the package's own modules) may import any folder but the programs; nothing imports a program.
FOLDERS = {
    "qtensor.core": {"qtensor.core"},
    "qtensor.formats": {"qtensor.core", "qtensor.formats"},
    "qtensor.gemm": {"qtensor.core", "qtensor.gemm"},
    "qtensor.distributed": {"qtensor.core", "qtensor.distributed"},
    "qtensor.layers": {"qtensor.core", "qtensor.gemm", "qtensor.distributed", "qtensor.layers"},
    "qtensor_kernels": {"qtensor.core", "qtensor.formats", "qtensor_kernels"},
}
PROGRAMS = ("qtensor.demo", "qtensor.study")


def folder_of(module: str) -> str:
    """The folder a module belongs to: `qtensor.core.tensor` -> `qtensor.core`; a module of the model
    level (`qtensor.quantize`, the package itself) -> `qtensor`."""
    if module.startswith("qtensor_kernels"):
        return "qtensor_kernels"
    parts = module.split(".")
    if len(parts) >= 2 and ".".join(parts[:2]) in set(FOLDERS) | set(PROGRAMS):
        return ".".join(parts[:2])
    return "qtensor"


def test_every_folder_imports_only_the_folders_below_it():
    edges = import_edges(module_files())
    wrong = []
    for module, targets in edges.items():
        folder = folder_of(module)
        for target in targets:
            where = folder_of(target)
            if where in PROGRAMS:
                allowed = folder == where
            elif folder in FOLDERS:
                allowed = where in FOLDERS[folder]
            else:  # the model level and the programs: anything but another program
                allowed = True
            if not allowed:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering (docs/architecture.md): " + "; ".join(sorted(wrong))
    assert any(folder_of(m) == "qtensor_kernels" and "qtensor.formats" in {folder_of(t) for t in ts} for m, ts in edges.items())


def test_no_module_is_imported_by_a_name_in_a_string():
    """importlib with a computed name would hide an edge from the graph above (the kernel table once
    found its kernels so); only the table of old module paths (legacy.py) imports by name."""
    for module, path in module_files().items():
        if module == "qtensor.legacy":
            continue
        source = open(path).read()
        assert "import_module(" not in source and "__import__(" not in source, f"{module} imports a module named in a string"


CORE = {m for m in module_files() if folder_of(m) == "qtensor.core"}

_LOADED = """
import importlib, os, sys, types
package = types.ModuleType("qtensor")  # the package without running its __init__.py
package.__path__ = [os.path.join(sys.argv[1], "qtensor")]
sys.modules["qtensor"] = package
importlib.import_module(sys.argv[2])
print(sorted(name for name in sys.modules if name.startswith("qtensor.") or name.startswith("qtensor_kernels")))
"""


def loaded_by(module: str) -> set[str]:
    """The `qtensor.*` modules a fresh interpreter holds after importing `module` alone (forked
    from one that has imported torch only: fresh.py)."""
    done = run_python(_LOADED, ROOT, module, cwd=ROOT, preload=("torch",), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))


FORMATS = ["float8", "float8_block", "mxfp8", "nvfp4", "identity", "hybrid"]
LAYER_CASES = [
    ("qtensor.core.tensor", {"qtensor.core"}),
    ("qtensor.core.storage", {"qtensor.core"}),
    ("qtensor.gemm.dense", {"qtensor.core", "qtensor.gemm"}),
    ("qtensor.distributed.fsdp", {"qtensor.core", "qtensor.distributed"}),
] + [(f"qtensor.formats.{fmt}", {"qtensor.core", "qtensor.formats"}) for fmt in FORMATS]


@pytest.mark.parametrize("module, allowed", LAYER_CASES, ids=[case[0] for case in LAYER_CASES])
def test_a_low_layer_loads_nothing_above_it(module, allowed):
    """What actually loads, in a fresh interpreter: the import graph could miss an import made some
    other way."""
    loaded = loaded_by(module)
    assert module in loaded  # the check ran on the module itself
    above = sorted(name for name in loaded if folder_of(name) not in allowed and name not in ("qtensor." + f for f in ("core", "formats", "gemm", "distributed")))
    assert not above, f"importing {module} loads {above}"


@pytest.mark.parametrize("module", sorted(m for m in module_files() if m == "qtensor" or m.startswith("qtensor.")))
def test_every_module_is_short_enough_to_hold_in_mind(module):
    with open(module_files()[module]) as file:
        lines = len(file.read().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"
