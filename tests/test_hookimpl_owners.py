"""Every hook implementation belongs to the module that defines it: no ``@hookimpl`` function is
imported from one module (another plugin, a core helper) into a plugin, where it would run as
that plugin's without being visible in its source."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parents[1]
MARKER = "engine_impl"  # the attribute pluggy's HookimplMarker("engine") sets
CORE = sorted(info.name for info in pkgutil.walk_packages(engine.__path__, "engine.")
              if not info.name.endswith("__main__"))
PLUGINS = sorted(path.name for folder in ("plugins", "contrib") for path in (ROOT / folder).glob("*/engine_*")
                 if (path / "__init__.py").is_file())


def _borrowed_hooks(module) -> list[str]:
    return [f"{name} (from {value.__module__})" for name, value in vars(module).items()
            if callable(value) and hasattr(value, MARKER) and value.__module__ != module.__name__]


@pytest.mark.parametrize("module_name", CORE + PLUGINS)
def test_hookimpls_are_defined_where_they_are_registered(module_name):
    module = importlib.import_module(module_name) if module_name in CORE else pytest.importorskip(module_name)
    assert _borrowed_hooks(module) == []


def test_the_check_finds_a_borrowed_hookimpl():
    import types

    helpers, plugin = types.ModuleType("engine_helpers"), types.ModuleType("engine_someplugin")
    exec("from engine import hookimpl\n@hookimpl\ndef on_train_start(run):\n    pass\n", vars(helpers))
    assert _borrowed_hooks(helpers) == []
    plugin.on_train_start = helpers.on_train_start  # what "from engine_helpers import on_train_start" does
    assert _borrowed_hooks(plugin) == ["on_train_start (from engine_helpers)"]
