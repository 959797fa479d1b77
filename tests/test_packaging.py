"""Every first-party plugin folder is a distribution the root extras and the catalogue agree on."""

from pathlib import Path

import pytest
import tomllib

from engine.catalogue import FIRST_PARTY
from engine.plugins import describe_installed, installed_plugins

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def _toml(path):
    return tomllib.loads(path.read_text())


def test_every_plugin_folder_has_an_extra_and_all_includes_them():
    extras = _toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    names = [folder.name for folder in FOLDERS]
    assert names, "no plugin folders found"
    for name in names:
        assert extras[name] == [f"engine-{name}"], name
    (everything,) = extras["all"]
    assert everything.startswith("engine[") and set(everything[7:-1].split(",")) == set(names)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: folder.name)
def test_plugin_distribution_matches_the_catalogue(folder):
    project = _toml(folder / "pyproject.toml")["project"]
    name = folder.name
    assert project["name"] == f"engine-{name}"
    (entry,) = project["entry-points"]["engine.plugins"].items()
    # the package, or a class in it (instantiated per run, for plugins that keep state)
    assert entry[0] == name and entry[1].partition(":")[0] == f"engine_{name}", entry
    assert "engine" in project["dependencies"]
    assert not any(dep.split("=")[0].split(">")[0].strip() == "torch" and "==" in dep
                   for dep in project["dependencies"]), "torch is pinned only in the dev/CI install"
    assert (folder / "README.md").is_file() and list((folder / "tests").glob("test_*.py"))
    assert name in FIRST_PARTY and FIRST_PARTY[name].distribution == project["name"]
    installed = installed_plugins()[name]  # ./dev.sh setup installs every plugin folder
    _, registered, problems = describe_installed(installed)
    assert problems == []
    assert {kind: tuple(sorted(v)) for kind, v in registered.items()} == \
        {kind: tuple(sorted(v)) for kind, v in FIRST_PARTY[name].provides.items()}
