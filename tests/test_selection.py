"""Which installed plugins may load: ENGINE_PLUGINS, ENGINE_DISABLE_PLUGIN_AUTOLOAD, required_plugins,
and where each plugin of a run came from (``engine plan``)."""

import sys

import pytest

from engine import Run
from engine.cli import main
from engine.errors import ConfigError

OPTIMIZER_PLUGIN = """
import torch
from engine import hookimpl

@hookimpl
def register_optimizers(register):
    register("plain_sgd", lambda run, params: torch.optim.SGD(params, lr=run.config.train.learning_rate))
"""
# a plugin whose import leaves a trace: importing it is what the controls must prevent
IMPORT_TRACE = "import builtins\nbuiltins.engine_test_imported.append(__name__)\n"


@pytest.fixture
def imported():
    """The names of the tracing test plugins imported so far."""
    import builtins

    builtins.engine_test_imported = []
    yield builtins.engine_test_imported
    del builtins.engine_test_imported


def _plan(capfd, *args):
    assert main(["plan", *args]) == 0
    return capfd.readouterr().out


# ---------------------------------------------------------------------------- ENGINE_PLUGINS


def test_engine_plugins_adds_plugins_to_every_run_after_the_runs_own(monkeypatch, capfd):
    monkeypatch.setenv("ENGINE_PLUGINS", "early_stopping")
    run = Run({"plugins": ["lion"], "train": {"eval_strategy": "steps", "metric_for_best_model": "loss"},
               "data": {"eval_split": 0.1}})
    assert run.config.plugins == ["lion", "early_stopping"]
    out = _plan(capfd, "--plugins", "+lion")
    assert "early_stopping           engine 0.1.0, entry point engine.builtin.early_stopping:EarlyStopping; named by " \
           "ENGINE_PLUGINS" in out
    assert "lion                     engine-lion 0.1.0, entry point engine_lion; named by --plugins" in out


def test_the_command_line_can_switch_off_what_engine_plugins_adds(monkeypatch):
    monkeypatch.setenv("ENGINE_PLUGINS", "lion")
    assert Run({}, plugin_edits=["-lion"]).config.plugins == []


def test_an_excluded_plugin_is_never_loaded_and_takes_its_section_with_it(monkeypatch, entry_point_plugin, imported,
                                                                         capfd):
    module = entry_point_plugin("traced", IMPORT_TRACE)
    monkeypatch.setenv("ENGINE_PLUGINS", "-traced,-lion")
    run = Run({"plugins": ["traced", "lion"], "lion": {"z_loss": 0.1}})
    assert run.config.plugins == [] and "lion" not in run.config.sections
    assert imported == [] and module not in sys.modules
    err = capfd.readouterr().err
    assert "engine: ENGINE_PLUGINS excludes 'traced', 'lion': not loaded in this run" in err
    out = _plan(capfd, "--plugins", "+lion")
    assert "excluded by ENGINE_PLUGINS: traced, lion" in out and "engine_lion;" not in out


@pytest.mark.parametrize("value, fragment", [
    ("a b", "ENGINE_PLUGINS: 'a b' is not a plugin name; expected comma-separated names, '-name' to keep one"),
    ("lion,-lion", "ENGINE_PLUGINS: lion both added and excluded; keep one"),
    ("-", "ENGINE_PLUGINS: '-' is not a plugin name"),
])
def test_a_malformed_engine_plugins_is_one_line(monkeypatch, capfd, value, fragment):
    monkeypatch.setenv("ENGINE_PLUGINS", value)
    assert main(["plan"]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"engine: error: {fragment}") and err.count("\n") == 1


def test_a_plugin_switched_off_on_the_command_line_takes_its_section_with_it(entry_point_plugin, capfd):
    entry_point_plugin("other", OPTIMIZER_PLUGIN)
    run = Run({"plugins": ["lion"], "lion": {"z_loss": 0.1}}, plugin_edits=["-lion"])
    assert run.config.plugins == [] and run.config.sections == {}
    replaced = Run({"plugins": ["lion"], "lion": {"z_loss": 0.1}}, plugin_edits=["other"])
    assert replaced.config.plugins == ["other"] and replaced.config.sections == {}
    assert "lion" not in _plan(capfd, "-p", "+lion", "-p", "-lion").split("hooks (")[0]


# ---------------------------------------------------------------------------- ENGINE_DISABLE_PLUGIN_AUTOLOAD


def test_without_autoload_the_listing_imports_only_named_plugins(monkeypatch, entry_point_plugin, imported, capfd):
    entry_point_plugin("traced", IMPORT_TRACE)
    entry_point_plugin("named", IMPORT_TRACE + OPTIMIZER_PLUGIN)
    monkeypatch.setenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert main(["plugins", "--plugins", "+named"]) == 0
    rows = {line.split()[0]: line for line in capfd.readouterr().out.splitlines() if line.startswith("  ")}
    assert imported == ["engine_test_named"]
    assert "not imported (ENGINE_DISABLE_PLUGIN_AUTOLOAD is set)" in rows["traced"]
    assert "registers optimizer plain_sgd" in rows["named"]
    monkeypatch.delenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD")
    assert main(["plugins"]) == 0  # with autoload, the listing imports every plugin to show its hooks
    assert imported == ["engine_test_named", "engine_test_traced"]


def test_without_autoload_an_unknown_name_does_not_search_the_installed_plugins(monkeypatch, entry_point_plugin,
                                                                                imported):
    entry_point_plugin("thirdparty", IMPORT_TRACE + OPTIMIZER_PLUGIN)
    monkeypatch.setenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(ConfigError) as err:
        Run({"train": {"optim": "plain_sgd"}})
    assert imported == []
    assert "; installed plugins were not searched for it (ENGINE_DISABLE_PLUGIN_AUTOLOAD is set)" in str(err.value)
    monkeypatch.setenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD", "0")  # 0 means autoload stays on
    with pytest.raises(ConfigError, match="it is registered by installed plugin 'thirdparty'"):
        Run({"train": {"optim": "plain_sgd"}})
    assert imported == ["engine_test_thirdparty"]


def test_without_autoload_named_plugins_still_load_and_the_plan_says_so(monkeypatch, entry_point_plugin, capfd):
    entry_point_plugin("named", OPTIMIZER_PLUGIN)
    monkeypatch.setenv("ENGINE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("ENGINE_PLUGINS", "named")
    out = _plan(capfd, "--set", "train.optim=plain_sgd")
    assert "optimizer  selected 'plain_sgd' from named" in out
    assert "ENGINE_DISABLE_PLUGIN_AUTOLOAD is set: no other installed plugin is imported" in out


# ---------------------------------------------------------------------------- required_plugins


def test_required_plugins_that_are_installed_at_the_version_pass(capfd, tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('required_plugins = ["lion>=0.1,<1", "engine-lion", "engine>=0.1", '
                        '"galore; sys_platform == \'nowhere\'"]\nplugins = ["lion"]\n')
    out = _plan(capfd, str(run_file))
    assert 'required_plugins = ["lion>=0.1,<1", "engine-lion", "engine>=0.1"' in out
    assert "required_plugins satisfied: lion>=0.1,<1" in out


@pytest.mark.parametrize("required, message", [
    (["lion>=0.2"], "required_plugins[0]: the run needs 'lion>=0.2', but engine-lion 0.1.0 is installed; "
                    "pip install -U 'engine-lion', or change required_plugins"),
    (["engine>=99"], "required_plugins[0]: the run needs 'engine>=99', but engine 0.1.0 is installed; "
                     "pip install -U engine"),
    (["lion", "nowhere_xyz"], "required_plugins[1]: 'nowhere_xyz': plugin 'nowhere_xyz' is not installed; install "
                              "the distribution that provides it (pip install 'nowhere_xyz'); installed plugins: "),
    (["lion>>1"], "required_plugins[0]: 'lion>>1' is not a requirement ("),
    (["lion[extra]"], "required_plugins[0]: 'lion[extra]': name a plugin and versions only"),
    ("lion", "required_plugins: expected list of str like [\"galore>=0.2\"], got str 'lion'"),
])
def test_required_plugins_are_refused_before_anything_loads(entry_point_plugin, imported, required, message):
    entry_point_plugin("traced", IMPORT_TRACE)
    with pytest.raises(ConfigError) as err:
        Run({"required_plugins": required, "plugins": ["traced"]})
    assert str(err.value).startswith(message)
    assert imported == []


def test_a_required_first_party_plugin_names_its_extra():
    from engine.plugins import check_required_plugins

    with pytest.raises(ConfigError, match=r"^required_plugins\[0\]: 'galore>=0.1': plugin 'galore' is not installed; "
                                          r"it comes from engine-galore: pip install 'engine\[galore\]'; installed "
                                          r"plugins: \(none\)$"):
        check_required_plugins(["galore>=0.1"], installed={})


def test_a_required_plugin_at_another_version_names_the_installed_one(entry_point_plugin):
    entry_point_plugin("old", OPTIMIZER_PLUGIN)
    with pytest.raises(ConfigError,
                       match=r"the run needs 'old>=0.2', but engine-test-old 0.1 is installed"):
        Run({"required_plugins": ["old>=0.2"]})
    assert Run({"required_plugins": ["engine-test-old==0.1"]}).config.required_plugins == ["engine-test-old==0.1"]
