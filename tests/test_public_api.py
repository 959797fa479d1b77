"""One public API for plugin authors: top-level ``engine`` names and the kits.

plugins/ (first-party) and contrib/ (written as a third party would) are held to it alike, so a
third party can write anything ours do; deferred imports, ``import engine`` attribute use and
imports by name (``importlib.import_module("engine.x")``) count as imports.
"""

import ast
import importlib
import os
import sys
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_CODE = sorted(p for p in (*ROOT.glob("plugins/*/engine_*"), *ROOT.glob("contrib/*/engine_*")) if p.is_dir())
KIT_MODULES = {"engine.testing", "engine.tracking", "engine.loss", "engine.optim", "engine.metrics", "engine.kit",
               *(f"engine.kit.{p.stem}" for p in (ROOT / "engine" / "kit").glob("*.py") if p.stem != "__init__")}
# Old module paths kept for one release: importing one warns and names the new path.
MOVED = {"engine.lowrank": "engine.kit.lowrank"}


def _is_module(name):
    return (ROOT / Path(*name.split("."))).with_suffix(".py").is_file() or (ROOT / Path(*name.split("."))).is_dir()


def _public(module, name=None):
    """Whether ``from module import name`` (``import module`` when name is None) uses the public API."""
    if module == "engine":
        return name is None or name in engine.__all__ or f"engine.{name}" in KIT_MODULES
    if module not in KIT_MODULES:
        return False
    if name is None or f"{module}.{name}" in KIT_MODULES:
        return True
    listed = getattr(importlib.import_module(module), "__all__", None)
    return listed is None or name in listed


def _engine_uses(tree):
    """(line, module, name) of every use of the engine in a module's syntax tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "engine")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "engine":
            yield from ((node.lineno, node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine":
            yield node.lineno, "engine", node.attr  # import engine; engine.checkpoint.save(...)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("engine."):
            module = node.value.partition(":")[0]
            if _is_module(module):  # a logger name such as "engine.hub" names no module
                yield node.lineno, module, None


def _private_uses(folder):
    for path in sorted(folder.rglob("*.py")):
        for line, module, name in sorted(_engine_uses(ast.parse(path.read_text())), key=lambda use: use[0]):
            if not _public(module, name):
                yield f"{os.path.relpath(path, ROOT)}:{line} uses {module}{'.' + name if name else ''}"


@pytest.mark.parametrize("folder", PLUGIN_CODE, ids=lambda folder: str(folder.relative_to(ROOT).parent))
def test_plugin_code_imports_only_the_public_api(folder):
    assert list(_private_uses(folder)) == []


def test_the_check_sees_every_kind_of_import(tmp_path):
    (tmp_path / "code.py").write_text(
        "import engine\nimport engine.checkpoint\nfrom engine import lowrank, hookimpl\nfrom engine.kit import lowrank\n"
        "def f():\n    from engine.rundir import env_rank\n    return engine.rundir.env_rank(), engine.strategy_name\n"
        "importlib.import_module('engine.layout')\nlogger = logging.getLogger('engine.hub')\n"
        "from engine.kit.checkpoint import torch\nfrom engine.kit.checkpoint import write_model\n")
    assert [use.partition(" uses ")[2] for use in _private_uses(tmp_path)] == [
        "engine.checkpoint", "engine.lowrank", "engine.rundir.env_rank", "engine.rundir", "engine.layout",
        "engine.kit.checkpoint.torch"]


@pytest.mark.parametrize("module", sorted(KIT_MODULES))
def test_each_kit_exports_what_it_lists(module):
    kit = importlib.import_module(module)
    assert kit.__doc__
    assert [name for name in getattr(kit, "__all__", ()) if not hasattr(kit, name)] == []


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_keeps_its_old_path_for_one_release(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        shim = importlib.import_module(old)
    assert [name for name in new.__all__ if getattr(shim, name) is not getattr(new, name)] == []


def test_every_kit_is_documented_in_the_plugin_guide():
    guide = (ROOT / "docs" / "writing-plugins.md").read_text()
    assert [module for module in sorted(KIT_MODULES) if f"`{module}`" not in guide] == []
