"""Settings and fixtures for every test run from the repository root (tests/, contrib/, plugins/)."""

import atexit
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

# The test models are tiny: one thread is far faster than two OpenMP workers waiting on each
# other on a busy 2-core machine (a 7-step run took 10x longer). Subprocess tests keep torch's
# default.
torch.set_num_threads(1)

# trackio reads TRACKIO_DIR once, when imported: every test's trackio runs go into one temporary
# store (tests tell them apart by project), never into the user's ~/.cache
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="engine-test-trackio-")

# datasets caches what it reads: a folder of this test session (subprocesses inherit it), not the
# user's ~/.cache; and nothing asks the Hub.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="engine-tests-datasets-")
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the end-of-run report's curves cost ~0.6 s per run (plus matplotlib's import): the suite trains
# hundreds of runs, so no report unless a test asks for one (tests/test_report.py)
os.environ["ENGINE_REPORT"] = "off"


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
