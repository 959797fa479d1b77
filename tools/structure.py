#!/usr/bin/env python3
"""The engine's structure, measured: layers, import cycles and the kernel's size budgets.

    python tools/structure.py        # from the repository root: prints the figures, exit 1 if over

The import graph counts every kind of import: module level, deferred (inside a function),
``TYPE_CHECKING`` and by name (a string ``"engine.x.y"`` that code imports later). Layers, lowest first:

    leaves   < kernel < kits < builtins < top
    errors,    the rest   optim,      engine.builtin.*   engine.testing,
    util, ...  of engine/ tracking,                      engine.tooling.*
                          engine.kit.*

A module may import its own layer and the layers below it; the kernel also never imports a kit. A
deprecation shim (a module at an old path that only warns and re-exports) is outside the layers.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {"engine.errors", "engine.util", "engine.layout", "engine.loss", "engine.metrics", "engine.catalogue"}
# test helpers build tiny runs with the builtins, and `python -m engine` starts the CLI: both sit on top
TOP_KITS = {"engine.testing", "engine.__main__"}
KITS = {"engine.optim", "engine.tracking"}  # and the engine.kit package
# the modules the issue budgets as the kernel: the contract and the skeleton
KERNEL_BUDGET = 4500
KERNEL_CORE = ("hookspecs", "plugins", "config", "run", "loop", "state", "strategy", "checkpoint", "rundir", "cli",
               "plan")
TOP_LEVEL_BUDGET = 5000  # every engine/*.py that is neither a kit nor a shim
LOOP_BUDGET, FUNCTION_BUDGET = 450, 80
LAYERS = ("leaf", "kernel", "kit", "builtin", "top")


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in (root / "engine").rglob("*.py"):
        if "scaffold" in path.parts:  # templates written by `engine plugins new`, not engine code
            continue
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def is_shim(path: Path) -> bool:
    """A deprecated old path: its code only warns and re-exports."""
    text = path.read_text()
    return "DeprecationWarning" in text and "deprecated" in (ast.get_docstring(ast.parse(text)) or "").lower() \
        and len(text.splitlines()) <= 30


def layer(name: str) -> str:
    if name in LEAVES:
        return "leaf"
    if name in TOP_KITS or name.startswith("engine.tooling"):
        return "top"
    if name.startswith("engine.builtin"):
        return "builtin"
    if name in KITS or name == "engine.kit" or name.startswith("engine.kit."):
        return "kit"
    return "kernel"


def _target(current: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base) + ("." + node.module if node.module else "")


def imports(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module: line} for every engine module, by every kind of import."""
    edges: dict[str, dict[str, int]] = {name: {} for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[str] = []
            if isinstance(node, ast.ImportFrom):
                target = _target(name, path, node)
                for alias in node.names:
                    found.append(next((c for c in (f"{target}.{alias.name}", target) if c in mods), ""))
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and name != "engine":
                # by name: "engine.x.y" or "engine.x.y:attr" (the package's own lazy table resolves on access)
                text = node.value.split(":")[0]
                if re.fullmatch(r"engine(\.\w+)+", text):
                    found = [text]
            for target in found:
                if target in mods and target != name:
                    edges[name].setdefault(target, node.lineno)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def layer_violations(mods: dict[str, Path], edges: dict[str, dict[str, int]]) -> list[str]:
    shims = {name for name, path in mods.items() if is_shim(path)}
    problems = []
    for name, targets in edges.items():
        if name in shims or name == "engine":  # the package's lazy attribute table names every public module
            continue
        own = LAYERS.index(layer(name))
        for target, line in targets.items():
            if target in shims or target == "engine":
                continue
            other = LAYERS.index(layer(target))
            if other > own or (layer(name) == "kernel" and layer(target) == "kit"):
                problems.append(f"{mods[name].relative_to(ROOT)}:{line}: {layer(name)} {name} imports "
                                f"{layer(target)} {target}")
    return sorted(problems)


def longest_function(path: Path) -> tuple[int, str]:
    lengths = [(node.end_lineno - node.lineno + 1, node.name) for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return max(lengths, default=(0, ""))


def figures(root: Path = ROOT) -> dict[str, object]:
    mods = modules(root)
    edges = imports(mods)
    engine_dir = root / "engine"
    top_level = [p for p in engine_dir.glob("*.py")
                 if layer(f"engine.{p.stem}") in ("leaf", "kernel") and p.stem not in ("loss", "metrics", "__main__")
                 and not is_shim(p)]
    loop = engine_dir / "loop.py"
    return {
        "kernel_lines": sum(len((engine_dir / f"{m}.py").read_text().splitlines()) for m in KERNEL_CORE
                            if (engine_dir / f"{m}.py").exists()),
        "top_level_lines": sum(len(p.read_text().splitlines()) for p in top_level),
        "loop_lines": len(loop.read_text().splitlines()),
        "longest_loop_function": longest_function(loop),
        "cycles": cycles(edges),
        "layer_violations": layer_violations(mods, edges),
    }


def over_budget(found: dict[str, object]) -> list[str]:
    problems = []
    if found["kernel_lines"] > KERNEL_BUDGET:
        problems.append(f"kernel {found['kernel_lines']} lines > {KERNEL_BUDGET}")
    if found["top_level_lines"] > TOP_LEVEL_BUDGET:
        problems.append(f"engine/*.py {found['top_level_lines']} lines > {TOP_LEVEL_BUDGET}")
    if found["loop_lines"] > LOOP_BUDGET:
        problems.append(f"loop.py {found['loop_lines']} lines > {LOOP_BUDGET}")
    if found["longest_loop_function"][0] > FUNCTION_BUDGET:
        problems.append("loop.py's {1} is {0} lines > ".format(*found["longest_loop_function"]) + str(FUNCTION_BUDGET))
    problems += [f"import cycle: {' <-> '.join(c)}" for c in found["cycles"]]
    problems += found["layer_violations"]
    return problems


def main() -> int:
    found = figures()
    length, name = found["longest_loop_function"]
    print(f"kernel (hookspecs, plugins, config, run, loop, state, strategy, checkpoint, rundir, cli, plan): "
          f"{found['kernel_lines']} lines (budget {KERNEL_BUDGET})")
    print(f"engine/*.py without kits and shims: {found['top_level_lines']} lines (budget {TOP_LEVEL_BUDGET})")
    print(f"loop.py: {found['loop_lines']} lines (budget {LOOP_BUDGET}); longest function {name}: {length} lines "
          f"(budget {FUNCTION_BUDGET})")
    print(f"import cycles: {len(found['cycles'])}; layer violations: {len(found['layer_violations'])}")
    problems = over_budget(found)
    for problem in problems:
        print(f"  {problem}")
    print("ok" if not problems else f"over: {len(problems)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
