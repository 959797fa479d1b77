"""Composition from plugin names: discovery, loading, registries, error messages."""

import subprocess
import sys

import pytest
import torch

from engine import Run, hookimpl
from engine.errors import ConfigError, PluginError
from engine.plugins import PluginManager, installed_plugins, unknown_plugin_message
from engine.testing import run_steps

OPTIMIZER_PLUGIN = """
    import torch
    from engine import hookimpl

    @hookimpl
    def register_optimizers(register):
        register("plain_sgd", lambda run, params: torch.optim.SGD(params, lr=run.config.train.learning_rate))
"""


def test_listing_reads_metadata_without_importing(entry_point_plugin):
    module = entry_point_plugin("listed", OPTIMIZER_PLUGIN)
    found = installed_plugins()["listed"]
    assert (found.distribution, found.version) == ("engine-test-listed", "0.1")
    assert module not in sys.modules


def test_enabled_plugin_is_used_and_others_are_never_imported(entry_point_plugin, tmp_path):
    used = entry_point_plugin("used", OPTIMIZER_PLUGIN)
    unused = entry_point_plugin("unused", OPTIMIZER_PLUGIN.replace("plain_sgd", "other_sgd"))
    run = run_steps(2, plugins=["used"], output_dir=tmp_path, train={"optim": "plain_sgd"})
    assert type(run.optimizer) is torch.optim.SGD
    assert run.registries["optimizer"].get("plain_sgd").plugin == "used"
    assert used in sys.modules and unused not in sys.modules


def test_unknown_plugin_lists_installed_and_first_party_extra(entry_point_plugin, first_party):
    entry_point_plugin("present", OPTIMIZER_PLUGIN)
    with pytest.raises(PluginError) as err:
        PluginManager(["presnt"])
    assert "unknown plugin 'presnt'; did you mean 'present'?" in str(err.value)
    assert "installed plugins: " in str(err.value) and "present" in str(err.value)
    message = unknown_plugin_message("galore", installed=["present"])
    assert message == ("unknown plugin 'galore'; it comes from engine-galore: pip install 'engine[galore]'; "
                       "installed plugins: present (plugins are the entry points of group 'engine.plugins' of "
                       "installed distributions)")
    plugin, _ = first_party(installed=False)
    with pytest.raises(PluginError, match=rf"unknown plugin '{plugin}'; it comes from engine-{plugin}: "
                                          rf"pip install 'engine\[{plugin}\]'"):
        PluginManager([plugin])


def test_plugin_that_fails_to_import_is_fatal_and_names_the_module(entry_point_plugin):
    entry_point_plugin("broken", "import missing_dependency_xyz\n")
    with pytest.raises(PluginError, match=r"plugin 'broken' \(engine-test-broken\) failed to import: "
                                          r"missing module 'missing_dependency_xyz'"):
        PluginManager(["broken"])


def test_duplicate_registered_name_names_both_plugins(entry_point_plugin):
    entry_point_plugin("first", OPTIMIZER_PLUGIN)
    entry_point_plugin("second", OPTIMIZER_PLUGIN)
    with pytest.raises(PluginError, match="optimizer 'plain_sgd' is registered by both plugin 'first' "
                                          "and plugin 'second'; disable one"):
        PluginManager(["first", "second"])


def test_enabled_plugin_replaces_a_builtin_name(tmp_path):
    class FastSGD:
        @hookimpl
        def register_optimizers(self, register):
            register("adamw_torch", lambda run, params: torch.optim.SGD(params, lr=0.1))

    run = run_steps(1, objects=[FastSGD()], output_dir=tmp_path)
    assert type(run.optimizer) is torch.optim.SGD
    assert run.registries["optimizer"].get("adamw_torch").plugin == "FastSGD"


def test_unknown_optimizer_lists_names_and_the_extra_that_provides_it(first_party):
    plugin, name = first_party("optimizer", installed=True)
    with pytest.raises(ConfigError) as err:
        Run({"train": {"optim": name}})
    assert str(err.value).startswith(
        f"train.optim: unknown optimizer '{name}'; it comes from plugin '{plugin}', which is installed but not "
        f"enabled: add '{plugin}' to plugins (or --plugins +{plugin}); available: adafactor, adagrad, adamw_torch")
    plugin, name = first_party("strategy", installed=False)
    with pytest.raises(ConfigError) as err:
        Run({"train": {"strategy": name}})
    assert str(err.value).startswith(
        f"train.strategy: unknown strategy '{name}'; it comes from engine-{plugin}: "
        f"pip install 'engine[{plugin}]' and add '{plugin}' to plugins; available: single")
    with pytest.raises(ConfigError) as err:
        Run({"train": {"optim": "adamw_torhc"}})
    message = str(err.value)
    assert "did you mean 'adamw_torch'?" in message
    for plugin in ("bnb", "galore", "lomo"):  # installed here: enable them, never "pip install" them
        assert plugin in message.split("more in installed plugins ")[1].split(" (add one")[0]
        assert f"engine[{plugin}]" not in message


def test_unknown_scheduler_and_strategy_are_refused_at_configure():
    with pytest.raises(ConfigError, match="train.lr_scheduler_type: unknown scheduler 'cosin'; did you mean 'cosine'"):
        Run({"train": {"lr_scheduler_type": "cosin"}})
    # installed (as ./dev.sh installs every plugin) or not, the message says where ddp comes from
    with pytest.raises(ConfigError, match=r"train.strategy: unknown strategy 'ddp'; it comes from (engine-ddp|plugin "
                                          r"'ddp', which is installed but not enabled: add 'ddp' to plugins)"):
        Run({"train": {"strategy": "ddp"}})


def test_bad_optim_args_are_refused_before_the_model_loads():
    with pytest.raises(ConfigError, match="train.optim_args: sgd takes momentum, dampening, weight_decay, "
                                          "nesterov; got 'betas'"):
        Run({"train": {"optim": "sgd", "optim_args": "betas=0.9"}})
    with pytest.raises(ConfigError, match="train.optim_args: expected 'key=value,key=value'"):
        Run({"train": {"optim": "sgd", "optim_args": "momentum"}})
    with pytest.raises(ConfigError, match="train.optim_args: adamw_torch takes no optim_args"):
        Run({"train": {"optim_args": "momentum=0.9"}})


def test_optim_args_reach_the_optimizer(tmp_path):
    run = run_steps(1, output_dir=tmp_path, train={"optim": "sgd", "optim_args": "momentum=0.9,nesterov=True"})
    group = run.optimizer.param_groups[0]
    assert group["momentum"] == 0.9 and group["nesterov"] is True


def test_hook_name_typo_is_refused_with_suggestion():
    class Typo:
        @hookimpl
        def on_step_edn(self, run):
            pass

    with pytest.raises(PluginError, match="plugin 'Typo' implements unknown hook 'on_step_edn'; "
                                          "did you mean 'on_step_end'"):
        Run({}, plugins=[Typo()])


def test_wrong_hook_argument_is_refused():
    class WrongArgs:
        @hookimpl
        def on_step_end(self, run, step):
            pass

    with pytest.raises(PluginError, match="plugin 'WrongArgs'.*step"):
        Run({}, plugins=[WrongArgs()])


def test_plugins_are_called_in_list_order_before_builtins(tmp_path):
    calls = []

    def plugin(name):
        class P:
            @hookimpl
            def on_train_start(self, run):
                calls.append(name)

            @hookimpl
            def compute_loss(self, run, model, batch, num_items_in_batch):
                calls.append(f"loss:{name}")
                return None if name == "a" else model(**batch).loss

        P.name = name
        return P()

    run = run_steps(1, objects=[plugin("a"), plugin("b")], output_dir=tmp_path)
    assert calls[0:1] == ["a"] and calls[1] == "b"
    assert calls[2:4] == ["loss:a", "loss:b"]  # a passes (None), b answers, builtin never asked
    order = run.plugin_manager.call_order("compute_loss")
    assert order == ["a", "b", "builtin.loss"]


def test_two_strategy_plugins_are_refused_under_auto():
    from engine.strategy import Strategy

    def offering(name):
        class P:
            @hookimpl
            def register_strategies(self, register):
                register(name, Strategy)

        P.name = f"plugin_{name}"
        return P()

    with pytest.raises(ConfigError, match=r"train.strategy: enabled plugins offer several strategies "
                                          r"\(one \(plugin plugin_one\), two \(plugin plugin_two\)\)"):
        Run({}, plugins=[offering("one"), offering("two")])
    run = Run({"train": {"strategy": "two"}}, plugins=[offering("one"), offering("two")])
    assert "selected 'two' from plugin_two" in run.plan()


def test_plan_shows_order_answering_plugin_and_full_config(entry_point_plugin):
    entry_point_plugin("planned", OPTIMIZER_PLUGIN)
    text = Run({"plugins": ["planned"], "train": {"optim": "plain_sgd"}}).plan()
    assert "planned                  engine-test-planned 0.1" in text
    assert "optimizer  selected 'plain_sgd' from planned" in text
    assert "register_optimizers      broadcast    planned, builtin.optimizers" in text
    assert 'lr_scheduler_type = "linear"' in text  # defaults filled in


def test_import_engine_stays_light():
    code = ("import sys, engine, engine.cli; engine.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_third_party_package_from_contrib_registers_an_optimizer_and_a_loss(tmp_path):
    """contrib/lion is installed from its own pyproject (see dev.sh): a real entry point."""
    assert "lion" in installed_plugins(), "install it: pip install -e contrib/lion"
    run = run_steps(15, plugins=["lion"], output_dir=tmp_path, sections={"lion": {"z_loss": 1e-3}},
                    train={"optim": "lion", "learning_rate": 3e-3})
    assert type(run.optimizer).__name__ == "Lion" and type(run.optimizer).__module__ == "engine_lion"
    assert run.plugin_manager.call_order("compute_loss")[0] == "lion"
    batch = run.data_collator([run.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        with_z = run.hook.compute_loss(run=run, model=run.model, batch=batch, num_items_in_batch=None)
        plain = run.model(**batch).loss
    assert with_z > plain  # the z-loss term is added by the plugin's loss
    losses = [e["loss"] for e in run.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name, instead", [
    ("adamw_torch_xla", "use adamw_torch"), ("adamw_torch_npu_fused", "use adamw_torch or adamw_torch_fused"),
    ("adamw_apex_fused", "use adamw_torch_fused"), ("adamw_anyprecision", "use adamw_torch with train.bf16 = true")])
def test_hardware_specific_trainer_optimizers_say_what_to_use_instead(name, instead):
    with pytest.raises(ConfigError, match=rf"^train\.optim: '{name}' is not supported on this engine: .*{instead}"):
        Run({"train": {"optim": name}})


def test_every_trainer_optimizer_name_is_provided_or_explained():
    from transformers.training_args import OptimizerNames

    from engine.catalogue import FIRST_PARTY, UNSUPPORTED_OPTIMIZERS

    known = set(Run({}).registries["optimizer"].names()) | set(UNSUPPORTED_OPTIMIZERS)
    for info in FIRST_PARTY.values():
        known |= set(info.provides.get("optimizer", ()))
    assert {name.value for name in OptimizerNames} - known == set()


# ---------------------------------------------------------------------------- a plugin author's mistakes


def test_a_forgotten_entry_point_says_how_to_add_it(site_dir, entry_point_plugin, monkeypatch):
    entry_point_plugin("other", OPTIMIZER_PLUGIN)  # makes the site folder importable
    (site_dir / "engine_gradclip.py").write_text("from engine import hookimpl\n")
    with pytest.raises(PluginError) as err:
        PluginManager(["gradclip"])
    assert str(err.value).startswith(
        "unknown plugin 'gradclip'; module 'engine_gradclip' is importable but no entry point 'gradclip' is "
        "installed in group 'engine.plugins': add [project.entry-points.\"engine.plugins\"] gradclip = "
        "\"engine_gradclip\" to its pyproject.toml and reinstall it (pip install -e .); installed plugins: ")


def test_a_misspelt_hook_argument_names_the_real_ones():
    class Misspelt:
        @hookimpl
        def compute_loss(self, run, model, batch, num_items):
            pass

    with pytest.raises(PluginError) as err:
        Run({}, plugins=[Misspelt()])
    assert str(err.value) == ("plugin 'Misspelt': compute_loss takes 'num_items' (did you mean "
                              "'num_items_in_batch'?), which the hook does not pass; compute_loss passes "
                              "(run, model, batch, num_items_in_batch), take any of them")


def test_a_hook_function_without_the_marker_is_refused(entry_point_plugin):
    entry_point_plugin("unmarked", "def on_step_end(run):\n    print('never called')\n")
    with pytest.raises(PluginError, match="^plugin 'unmarked' defines on_step_end without @engine.hookimpl, so it "
                                          "would never be called; mark it with @hookimpl$"):
        PluginManager(["unmarked"])


def test_a_plugin_whose_import_raises_is_one_error(entry_point_plugin):
    entry_point_plugin("crashing", "raise RuntimeError('needs MY_API_KEY')\n")
    with pytest.raises(PluginError, match=r"^plugin 'crashing' \(engine-test-crashing\) failed to import: "
                                          r"RuntimeError: needs MY_API_KEY$"):
        PluginManager(["crashing"])


def test_an_installed_but_broken_library_is_not_reported_as_missing(entry_point_plugin, site_dir):
    (site_dir / "broken_native.py").write_text("raise ImportError('libnative.so: cannot open shared object file')\n")
    entry_point_plugin("native", "import broken_native\n")
    with pytest.raises(PluginError) as err:
        PluginManager(["native"])
    assert str(err.value) == ("plugin 'native' (engine-test-native) failed to import: ImportError: libnative.so: "
                              "cannot open shared object file")
    from engine.util import require

    with pytest.raises(Exception) as err:
        require("broken_native", "native-lib")
    assert str(err.value).startswith("package 'native-lib' is installed but fails to import: ImportError: "
                                     "libnative.so: cannot open shared object file; reinstall it")
    with pytest.raises(Exception, match="package 'not-here' is needed .*: pip install not-here"):
        require("not_here_xyz", "not-here")
    with pytest.raises(Exception, match="package 'not-here' is needed .*: pip install 'engine\\[here\\]'"):
        require("not_here_xyz", "not-here", extra="here", import_now=False)  # looked for, not imported
    assert require("broken_native", import_now=False) is None  # found: its import is left to where it is used


def test_engine_plugins_lists_what_cannot_load_and_flags_mistakes(entry_point_plugin, capfd):
    from engine.cli import main

    entry_point_plugin("crashing", "raise RuntimeError('needs MY_API_KEY')\n")
    entry_point_plugin("typo", "from engine import hookimpl\n\n@hookimpl\ndef on_step_edn(run):\n    pass\n")
    entry_point_plugin("unmarked", "def on_step_end(run):\n    pass\n")
    assert main(["plugins"]) == 0
    out = capfd.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "cannot load: plugin 'crashing' (engine-test-crashing) failed to import: RuntimeError: needs MY_API_KEY" \
        in rows["crashing"]
    assert "PROBLEMS: unknown hook 'on_step_edn' (did you mean 'on_step_end'?)" in rows["typo"]
    assert "PROBLEMS: plugin 'unmarked' defines on_step_end without @engine.hookimpl" in rows["unmarked"]
    assert "enabled" not in rows["lion"] and "registers optimizer lion" in rows["lion"]


def test_an_unknown_optimizer_names_the_installed_plugin_that_registers_it(entry_point_plugin):
    entry_point_plugin("thirdparty", OPTIMIZER_PLUGIN)
    with pytest.raises(ConfigError) as err:
        Run({"train": {"optim": "plain_sgd"}})
    assert str(err.value).startswith(
        "train.optim: unknown optimizer 'plain_sgd'; it is registered by installed plugin 'thirdparty' "
        "(engine-test-thirdparty 0.1): add it to plugins (or --plugins +thirdparty); available: ")


def test_checkpoint_state_that_cannot_be_loaded_back_is_refused_at_save(tmp_path):
    from pathlib import Path

    class PathState:
        name = "paths"

        @hookimpl
        def checkpoint_state(self, run):
            return {"seen": [1, 2], "where": Path("/tmp")}

    with pytest.raises(PluginError, match=r"^plugin 'paths': checkpoint_state\(\)\['where'\] is a PosixPath; "
                                          r"checkpoints are loaded with weights_only=True"):
        run_steps(1, objects=[PathState()], output_dir=tmp_path, train={"save_strategy": "steps", "save_steps": 1})
    assert not list(tmp_path.glob("checkpoint-*"))


def test_a_plugin_hook_that_raises_is_one_line_naming_the_plugin(entry_point_plugin, tmp_path, capfd):
    from engine.cli import main

    entry_point_plugin("flaky", """
        from engine import hookimpl

        @hookimpl
        def on_step_end(run):
            if run.state.global_step == 2:
                raise ZeroDivisionError("the metric server said 0")
    """)
    (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of a corpus for a flaky plugin" for i in range(3000)))
    argv = ["train", "--plugins", "+flaky", "--set", f"train.output_dir={tmp_path}/out", "--set", "train.max_steps=3",
            "--set", f"data.train={tmp_path}/corpus.txt", "--set", 'train.eval_strategy="no"', "--set",
            "train.load_best_model_at_end=false", "--set", "data.eval_split=0.0"]
    assert main(argv) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("engine: error")]
    assert err == ["engine: error: plugin 'flaky' raised ZeroDivisionError: the metric server said 0 in on_step_end "
                   "(engine_test_flaky.py, line 7); --traceback shows where"]
    with pytest.raises(ZeroDivisionError):  # with --traceback, the exception itself
        main([*argv, "--traceback", "--set", "train.overwrite_output_dir=true"])


@pytest.mark.parametrize("plugin, install", [("bnb", "pip install 'engine[bnb]'"),
                                             ("thirdparty", "pip install not-here-lib")])
def test_an_optimizer_family_without_its_library_names_what_to_install(plugin, install):
    from engine import OptimizerFamily
    from engine.errors import MissingDependencyError

    family = OptimizerFamily(plugin, ("not_here_adamw",), lambda run, params, args: None,
                             library=("not_here_xyz", "not-here-lib"))

    class Family:
        @hookimpl
        def register_optimizers(self, register):
            family.register(register)

        @hookimpl
        def configure(self, run):
            family.configure(run)

    with pytest.raises(MissingDependencyError) as err:
        Run({"train": {"optim": "not_here_adamw"}}, plugins={plugin: Family()})
    assert str(err.value) == ("package 'not-here-lib' is needed for train.optim = 'not_here_adamw' (missing module "
                              f"'not_here_xyz'): {install}")
