
import pytest


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
