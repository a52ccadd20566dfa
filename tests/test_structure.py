"""The package's import graph: no cycle between the parts of keras_amp, and imports point down the floors.

Each file or subpackage directly under keras_amp/ is one node (`keras_amp.layers`,
`keras_amp.policy`, ...). The graph is read from the source with `ast` (every import, including
the ones inside functions), so nothing is imported. `from keras_amp import x` is an import of
`keras_amp.x`; `keras_amp/__init__.py`, the re-export face, is left out, and so is an
`import keras_amp` of it.
"""

import ast
import pathlib

import pytest

PACKAGE = "keras_amp"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

# Top to bottom; a node may import its own floor (no cycle) or any floor below it, never one above.
FLOORS = (
    ("people", ("cli", "doctor", "plotting", "state")),
    ("training-time tools", ("auto_precision", "callbacks", "diagnostics", "distribute")),
    ("precision mechanisms", ("layer_kinds", "layer_policies", "layers", "losses", "op_rules",
                              "optimizers", "recipe_roles", "recipes")),
    ("numerics, storage", ("custom_gradient", "memory", "numerics")),
    ("model inspection", ("model_graph",)),
    ("global state, facts, boundary", ("_compat", "dtypes", "hardware", "matmul16_policy", "policy", "validation",
                                         "version")),
)

# Floors that pass each other by: what the float32-island layers and the op rules share is in numerics.
INDEPENDENT = (("layers", "op_rules"),)

# (importing module, imported module) -> why the edge is allowed against the floors. Keep it small.
KNOWN_DEBTS: dict[tuple[str, str], str] = {}


def _module_name(path):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name):
    """Whether `name` (dotted, under keras_amp) is a module or subpackage of the source tree."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(node, module, is_package):
    """The keras_amp modules an `import` / `from ... import` statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolved against the importing module's package
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    # `from keras_amp import x` / `from keras_amp.layers import attention` import modules.
    names = [f"{source}.{alias.name}" for alias in node.names]
    return [n if _is_module(n) else source for n in names]


def import_edges():
    """Every (importing module, imported module) between two different nodes."""
    edges = set()
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "__init__.py":
            continue
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, path.name == "__init__.py"):
                if target.startswith(PACKAGE + ".") and node_of(target) != node_of(module):
                    edges.add((module, target))
    return edges


def node_of(module):
    return module.split(".")[1]


def nodes():
    return {p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"} | {
        p.parent.name for p in ROOT.glob("*/__init__.py")
    }


def _cycle(graph):
    """One cycle of `graph` (node -> set of nodes) as a list of nodes, or None."""
    done, on_path = set(), []

    def visit(n):
        if n in on_path:
            return on_path[on_path.index(n):] + [n]
        if n in done:
            return None
        on_path.append(n)
        for m in sorted(graph.get(n, ())):
            found = visit(m)
            if found:
                return found
        on_path.pop()
        done.add(n)
        return None

    for n in sorted(graph):
        found = visit(n)
        if found:
            return found
    return None


def _lines(edges):
    return "\n".join(f"  {a} -> {b}" for a, b in sorted(edges))


@pytest.fixture(scope="module")
def edges():
    found = import_edges()
    assert any(node_of(b) == "numerics" for _, b in found)  # guard: the parse sees package imports
    return found


def test_every_node_is_on_one_floor():
    placed = [n for _, floor in FLOORS for n in floor]
    assert len(placed) == len(set(placed)), placed
    assert set(placed) == nodes(), (
        f"Every module or subpackage under keras_amp/ belongs on exactly one floor. "
        f"Unplaced: {sorted(nodes() - set(placed))}; not in the tree: {sorted(set(placed) - nodes())}"
    )


def test_no_import_cycle_between_nodes(edges):
    graph = {}
    for a, b in edges:
        graph.setdefault(node_of(a), set()).add(node_of(b))
    cycle = _cycle(graph)
    if cycle:
        pairs = set(zip(cycle, cycle[1:]))
        on_cycle = {(a, b) for a, b in edges if (node_of(a), node_of(b)) in pairs}
        pytest.fail(f"Import cycle {' -> '.join(cycle)}:\n{_lines(on_cycle)}")


def test_imports_point_down_the_floors(edges):
    level = {n: i for i, (_, floor) in enumerate(FLOORS) for n in floor}
    upward = {(a, b) for a, b in edges if level[node_of(b)] < level[node_of(a)]}
    assert not upward - KNOWN_DEBTS.keys(), (
        "Imports from a lower floor to a higher one (FLOORS, top to bottom):\n"
        + _lines(upward - KNOWN_DEBTS.keys())
    )
    assert not KNOWN_DEBTS.keys() - upward, f"Debts paid off, remove them: {sorted(KNOWN_DEBTS.keys() - upward)}"


@pytest.mark.parametrize("pair", INDEPENDENT, ids=lambda p: " / ".join(p))
def test_independent_nodes_do_not_import_each_other(edges, pair):
    between = {(a, b) for a, b in edges if {node_of(a), node_of(b)} == set(pair)}
    assert not between, f"{' and '.join(pair)} share through numerics, not by importing each other:\n{_lines(between)}"


def mirrored_test(module_path):
    """tests/<package>/test_<module>.py for keras_amp/<package>/<module>.py (a leading "_" dropped)."""
    rel = module_path.relative_to(ROOT)
    name = "test_" + rel.stem.lstrip("_") + ".py"
    return ROOT.parent / "tests" / rel.parent / name


def test_every_module_has_a_mirrored_test_file():
    modules = [p for p in sorted(ROOT.rglob("*.py")) if p.name != "__init__.py"]
    assert len(modules) > 50  # guard: the tree was read
    missing = [f"{p.relative_to(ROOT.parent)} -> {mirrored_test(p).relative_to(ROOT.parent)}"
               for p in modules if not mirrored_test(p).is_file()]
    assert not missing, "Modules without their mirrored test file:\n" + "\n".join(missing)
