"""The import graph of ``src/torchnitro``, read from the AST: no module-level import cycles.

Two kinds of edges are counted separately:

* module-level imports (anything that runs when the module is imported: top level, class bodies,
  ``try``/``if`` blocks; ``if TYPE_CHECKING:`` blocks are skipped, they never run);
* function-level imports (inside a ``def``): they run on first call, so a cycle that needs one of
  them does not break an import, but it still ties a lower layer to a higher one.

A cycle through module-level imports fails. A cycle that closes only through a function-level
import fails too when it is new; both known lists below may only shrink (issue 17): a new cycle
fails, and a fixed one must be taken off its list. The same holds one level up, between subpackages
(a lower layer importing a higher one, even inside a function), with its own known list.

Layers (``LAYERS``, lowest first): no module imports a higher layer at module level; imports of a higher
layer inside a function and module-level imports of the ``torchnitro`` facade have shrink-only known lists.

The graph is every ``*.py`` below ``src/torchnitro`` (every subpackage: a test checks none is missed).
Names resolved lazily through a package's ``__getattr__`` (``torchnitro.optimize``) are not import
statements and are not edges; tests/test_public_api.py resolves each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "torchnitro"

# issue 17: module-level cycles that exist today; remove an entry when its cycle is fixed
KNOWN_MODULE_CYCLES: set[frozenset[str]] = set()

# issue 17: cycles that close only through an import inside a function; remove an entry when fixed
KNOWN_FUNCTION_CYCLES: set[frozenset[str]] = set()

# cycles between subpackages (both kinds of edge); remove an entry when fixed
KNOWN_PACKAGE_CYCLES: set[frozenset[str]] = set()

# the layers, lowest first: a module imports only its own layer and those below it (same rank: either way,
# the cycle tests above still apply). A new subpackage or top-level module must be placed here.
LAYERS: dict[str, int] = {
    "_lazy": 0, "errors": 0, "checksum": 0, "version": 0,
    "config": 1, "hardware": 1,
    "bench": 2,
    "kernels": 3,
    "nn": 4, "precision": 4, "hrr": 4, "memory": 4,
    "profile": 5, "hf": 5,
    "autotune": 6, "distributed": 6, "xla": 6,
    "serve": 7, "cli": 7, "__main__": 7,
}

# imports of a higher layer inside a function (never at module level), as (module, package); may only shrink.
# bench.suites: the built-in suites time kernels and nn models, imported when a suite runs. profile.cli: the
# `torchnitro profile` verb loads artifacts and models through autotune (the verb belongs in the CLI layer).
KNOWN_UPWARD_FUNCTION_IMPORTS: set[tuple[str, str]] = {
    ("torchnitro.bench.suites", "torchnitro.kernels"), ("torchnitro.bench.suites", "torchnitro.nn"),
    ("torchnitro.profile.cli", "torchnitro.autotune"),
}

# modules that import the ``torchnitro`` facade itself at module level (its lazy names hide which layer they
# reach; import the defining module instead: ``torchnitro.version`` for ``__version__``); may only shrink
KNOWN_FACADE_IMPORTS: set[str] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The torchnitro modules an import statement loads (a ``from pkg import sub`` names pkg.sub)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = node.module or ""
    if node.level:  # relative: strip one package level per dot beyond the first
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif base in known:
            out.add(base)
    return out


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.depth = 0  # > 0 inside a function body
        self.module_level: set[str] = set()
        self.function_level: set[str] = set()

    def _add(self, node: ast.Import | ast.ImportFrom) -> None:
        found = _targets(node, self.module, self.is_package, self.known) - {self.module}
        (self.function_level if self.depth else self.module_level).update(found)

    visit_Import = visit_ImportFrom = _add

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level edges, function-level edges) between torchnitro modules."""
    mods = _modules()
    known = set(mods)
    top: dict[str, set[str]] = {}
    inner: dict[str, set[str]] = {}
    for name, path in mods.items():
        c = _Collector(name, path.name == "__init__.py", known)
        c.visit(ast.parse(path.read_text(), str(path)))
        top[name], inner[name] = c.module_level, c.function_level - c.module_level
    return top, inner


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``import_graph()`` read once for the tests of this module (each test only reads it)."""
    return import_graph()


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.add(frozenset(comp))
    return found


def _describe(comps: set[frozenset[str]]) -> str:
    return "\n".join("  {" + ", ".join(sorted(c)) + "}" for c in sorted(comps, key=sorted))


def _check_only_shrinks(now: set[frozenset[str]], known: set[frozenset[str]], kind: str) -> None:
    new, fixed = now - known, known - now
    assert not new, f"new {kind} import cycle(s) in src/{PACKAGE}:\n{_describe(new)}"
    assert not fixed, (f"{kind} import cycle(s) listed as known are gone; take them off the list in "
                       f"tests/test_import_graph.py:\n{_describe(fixed)}")


def test_no_new_module_level_cycles(graph):
    top, _ = graph
    _check_only_shrinks(cycles(top), KNOWN_MODULE_CYCLES, "module-level")


def test_no_new_cycles_through_function_level_imports(graph):
    top, inner = graph
    both = {m: top[m] | inner[m] for m in top}
    _check_only_shrinks(cycles(both) - cycles(top), KNOWN_FUNCTION_CYCLES, "function-level")


def _package(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to: ``torchnitro.serve.server`` -> ``torchnitro.serve``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between subpackages and top-level modules, from the module edges (the root package left out)."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        if m == PACKAGE:
            continue
        out.setdefault(_package(m), set()).update(_package(t) for t in targets if t != PACKAGE)
    return {p: t - {p} for p, t in out.items()}


def test_the_graph_holds_every_subpackage(graph):
    top, _ = graph
    on_disk = {_module_name(d / "__init__.py") for d in (SRC / PACKAGE).rglob("*") if (d / "__init__.py").is_file()}
    assert {"torchnitro.distributed", "torchnitro.xla", "torchnitro.serve", "torchnitro.profile"} <= on_disk
    assert on_disk <= set(top), f"subpackages missing from the graph: {sorted(on_disk - set(top))}"
    for pkg in on_disk:  # each package's modules, not only its __init__
        files = {_module_name(f) for f in (SRC / pkg.replace(".", "/")).glob("*.py")}
        assert files <= set(top), f"{pkg}: modules missing from the graph: {sorted(files - set(top))}"


def test_no_new_cycles_between_subpackages(graph):
    top, inner = graph
    both = {m: top[m] | inner[m] for m in top}
    _check_only_shrinks(cycles(package_graph(both)), KNOWN_PACKAGE_CYCLES, "subpackage")


def test_package_graph_folds_modules_into_their_subpackage():
    g = package_graph({"torchnitro": {"torchnitro.a.x"}, "torchnitro.a.x": {"torchnitro.a.y", "torchnitro.b.z"},
                       "torchnitro.a.y": set(), "torchnitro.b.z": {"torchnitro.a", "torchnitro"}})
    assert g == {"torchnitro.a": {"torchnitro.b"}, "torchnitro.b": {"torchnitro.a"}}
    assert cycles(g) == {frozenset({"torchnitro.a", "torchnitro.b"})}


def test_the_graph_reader_sees_both_kinds_of_edge_and_finds_a_cycle(graph):
    top, inner = graph
    assert "torchnitro.errors" in top["torchnitro.hrr.ops"]  # a module-level import
    assert "torchnitro.bench" in inner["torchnitro.hrr.dispatch"] | top["torchnitro.hrr.dispatch"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_hrr_backend_imports_only_the_kernels_below_it(graph):
    top, inner = graph
    below = {"torchnitro.hrr.mkl_fft", "torchnitro.hrr.fft_kernel", "torchnitro.hrr.cuda_fft"}
    used = {m for m in top["torchnitro.hrr.backend"] | inner["torchnitro.hrr.backend"] if m.startswith("torchnitro.hrr")}
    assert used <= below, f"hrr.backend imports {sorted(used - below)} from the layer above it"


def _private_uses(path: Path, known: set[str]) -> list[str]:
    """``module._name`` reads and ``from module import _name`` of another torchnitro module's private names."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(PACKAGE):
            for a in n.names:
                full = f"{n.module}.{a.name}"
                if full in known:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"from {n.module} import {a.name} (line {n.lineno})")
        elif isinstance(n, ast.Import):
            aliases.update({a.asname: a.name for a in n.names if a.asname and a.name in known})
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                and n.attr.startswith("_") and not n.attr.startswith("__")):
            found.append(f"{aliases[n.value.id]}.{n.attr} (line {n.lineno})")
    return found


def test_hrr_modules_use_only_each_others_public_names():
    mods = _modules()
    uses = {m: _private_uses(p, set(mods)) for m, p in mods.items() if m.startswith("torchnitro.hrr")}
    assert not {m: u for m, u in uses.items() if u}, uses


def test_private_use_reader_finds_both_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from torchnitro.hrr import ops\nfrom torchnitro.hrr.ops import _EPS\nops._check(1)\nops.bind\n")
    got = _private_uses(f, {"torchnitro.hrr.ops"})
    assert got == ["from torchnitro.hrr.ops import _EPS (line 2)", "torchnitro.hrr.ops._check (line 3)"]


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[1]]


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module, package of the target) for each import of a higher layer (the facade left out)."""
    return {(m, _package(t)) for m, targets in graph.items() if m != PACKAGE
            for t in targets if t != PACKAGE and _layer(t) > _layer(m)}


def test_every_subpackage_and_top_level_module_has_a_layer(graph):
    top, _ = graph
    unplaced = {m.split(".")[1] for m in top if m != PACKAGE} - set(LAYERS)
    assert not unplaced, f"place these in LAYERS (tests/test_import_graph.py): {sorted(unplaced)}"


def test_no_module_level_import_of_a_higher_layer(graph):
    top, _ = graph
    up = upward_imports(top)
    assert not up, "module-level imports of a higher layer:\n" + "\n".join(f"  {m} -> {p}" for m, p in sorted(up))


def test_function_level_imports_of_a_higher_layer_only_shrink(graph):
    _, inner = graph
    up = upward_imports(inner)
    new, gone = up - KNOWN_UPWARD_FUNCTION_IMPORTS, KNOWN_UPWARD_FUNCTION_IMPORTS - up
    assert not new, f"new imports of a higher layer inside functions: {sorted(new)}"
    assert not gone, f"gone; take them off KNOWN_UPWARD_FUNCTION_IMPORTS: {sorted(gone)}"


def test_module_level_imports_of_the_facade_only_shrink(graph):
    top, _ = graph
    facade = {m for m, targets in top.items() if m != PACKAGE and PACKAGE in targets}
    new, gone = facade - KNOWN_FACADE_IMPORTS, KNOWN_FACADE_IMPORTS - facade
    assert not new, f"import the defining module, not the torchnitro facade: {sorted(new)}"
    assert not gone, f"gone; take them off KNOWN_FACADE_IMPORTS: {sorted(gone)}"


def test_upward_imports_are_found():
    graph = {"torchnitro.bench.x": {"torchnitro.autotune.api", "torchnitro.errors", "torchnitro"},
             "torchnitro.autotune.api": {"torchnitro.bench.x"}}
    assert upward_imports(graph) == {("torchnitro.bench.x", "torchnitro.autotune")}
