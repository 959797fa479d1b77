import sys
import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def entry_point_plugin(tmp_path, monkeypatch):
    """Install a plugin as a real distribution on sys.path: a module plus a .dist-info folder
    whose entry_points.txt registers it in group engine.plugins. Returns install(name, source)."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installed = []

    def install(name: str, source: str, module: str | None = None) -> str:
        module = module or f"engine_test_{name}"
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        dist = site / f"engine_test_{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: engine-test-{name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[engine.plugins]\n{name} = {module}\n")
        installed.append(module)
        return module

    yield install
    for module in installed:
        sys.modules.pop(module, None)


@pytest.fixture
def site_dir(tmp_path):
    return Path(tmp_path / "site")


@pytest.fixture
def first_party():
    """``first_party(kind=None, installed=False)``: see :func:`_first_party`."""
    return _first_party


def _first_party(kind=None, installed=False):
    """A first-party plugin (providing names of registry ``kind``, if given) that is (not)
    installed here, with one of its names; skips when this environment has none such."""
    from engine.catalogue import FIRST_PARTY
    from engine.plugins import installed_plugins

    present = installed_plugins()
    for plugin, info in FIRST_PARTY.items():
        names = info.provides.get(kind, ()) if kind else (plugin,)
        if names and (plugin in present) == installed:
            return plugin, names[0]
    pytest.skip(f"every first-party {kind or 'plugin'} is {'not ' if installed else ''}installed here")
