"""The core's modules import each other without a cycle.

Every import that can run counts: module-level ones and the ones inside functions (a lazy import
still ties two modules together). Imports under ``if TYPE_CHECKING:`` never run and only name
types for annotations (``run: Run``), so they are left out.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "engine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Module names an import statement may load (``from x import y`` may load ``x.y``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        edges, pending = set(), [ast.parse(path.read_text(encoding="utf-8"))]
        while pending:
            for child in ast.iter_child_nodes(pending.pop()):
                if _is_type_checking(child):
                    pending.extend(child.orelse)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges.update(name for name in _imported(child, module, path.name == "__init__.py")
                                 if name in paths and name != module)
                pending.append(child)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_the_graph_sees_lazy_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "engine.loop" in graph["engine.run"]  # imported inside Run.train
    assert "engine.run" not in graph["engine.hookspecs"]  # only under TYPE_CHECKING
    assert "engine.hookspecs" in graph["engine.plugins"]


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
