"""The layout shows the architecture (STYLE.md): modules import one way, low layers stand alone,
and every module is short enough to hold in mind.

The import graph is read from the source with `ast` (function-local imports included), not from
what happens to be loaded; the low layers are imported in a fresh interpreter where the package's
`__init__.py` does not run, so only what they themselves import gets loaded.
"""

import ast
import os
import subprocess
import sys

import pytest

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


LOW_LAYERS = {
    "qtensor.tensor", "qtensor.plan", "qtensor.storage", "qtensor.quantizer", "qtensor.numerics", "qtensor.kernels", "qtensor.running_state",
}
FORMATS = ["float8", "float8_block", "mxfp8", "nvfp4", "identity", "hybrid"]
HIGH_LAYERS = [
    "qtensor.linear", "qtensor.weight", "qtensor.fsdp", "qtensor.quantize", "qtensor.optim",
    "qtensor.routing", "qtensor.attention", "qtensor.checkpoint", "qtensor.dynamic_weight", "qtensor.layer",
    "qtensor.layer_state", "qtensor.sequence_parallel", "qtensor.tensor_parallel",
]

_LOADED = """
import importlib, os, sys, types
package = types.ModuleType("qtensor")  # the package without running its __init__.py
package.__path__ = [os.path.join(sys.argv[1], "qtensor")]
sys.modules["qtensor"] = package
importlib.import_module(sys.argv[2])
print(sorted(name for name in sys.modules if name.startswith("qtensor.")))
"""


def loaded_by(module: str) -> set[str]:
    """The `qtensor.*` modules a fresh interpreter holds after importing `module` alone."""
    done = subprocess.run(
        [sys.executable, "-c", _LOADED, ROOT, module], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))


def _is_format_layer(name: str) -> bool:
    return name == "qtensor.formats" or name.startswith("qtensor.formats.")


LAYER_CASES = [
    ("qtensor.tensor", lambda name: name in LOW_LAYERS),
    ("qtensor.storage", lambda name: name in {"qtensor.storage", "qtensor.numerics", "qtensor.kernels"}),
] + [(f"qtensor.formats.{fmt}", lambda name: name in LOW_LAYERS or _is_format_layer(name)) for fmt in FORMATS]


@pytest.mark.parametrize("module, allowed", LAYER_CASES, ids=[case[0] for case in LAYER_CASES])
def test_a_low_layer_loads_nothing_above_it(module, allowed):
    loaded = loaded_by(module)
    assert module in loaded  # the check ran on the module itself
    above = sorted(name for name in loaded if not allowed(name))
    assert not above, f"importing {module} loads {above}"
    assert not loaded & set(HIGH_LAYERS)


@pytest.mark.parametrize("module", sorted(m for m in module_files() if m == "qtensor" or m.startswith("qtensor.")))
def test_every_module_is_short_enough_to_hold_in_mind(module):
    with open(module_files()[module]) as file:
        lines = len(file.read().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"
