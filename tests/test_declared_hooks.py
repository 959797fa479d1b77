"""Hooks declared beside their callers: the builtins' extension points (engine/builtin/hookspecs.py) and a
third-party plugin's own hooks for other plugins join engine.hookspecs through the entry-point group
``engine.hookspecs``, and are then hooks like the kernel's: implemented, checked, listed and planned."""

import os
import subprocess
import sys
import textwrap

from engine import hookspecs
from engine.builtin import hookspecs as builtin_hookspecs


def test_the_builtins_extension_points_are_engine_hooks():
    declared = [name for name, value in vars(builtin_hookspecs).items() if hasattr(value, "engine_spec")]
    assert declared == ["keep_columns", "model_load_kwargs", "prediction_step", "on_prediction_step", "on_predict",
                        "locate_checkpoint", "trainer_argument_mappings"]
    assert all(getattr(hookspecs, name) is getattr(builtin_hookspecs, name) for name in declared)
    assert hookspecs.combine_kind("prediction_step") == "firstresult"
    assert "on_predict" in hookspecs.HOOK_NAMES and "trainer_argument_mappings" not in hookspecs.HOOK_NAMES


def _distribution(folder, name, specs_source, plugin_source):
    """A distribution engine-<name> on ``folder``: hook specs under engine.hookspecs, a plugin under engine.plugins."""
    package = folder / f"engine_{name}"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(plugin_source))
    (package / "hooks.py").write_text(textwrap.dedent(specs_source))
    metadata = folder / f"engine_{name}-0.1.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: engine-{name}\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text(f"[engine.hookspecs]\n{name} = engine_{name}.hooks\n\n"
                                               f"[engine.plugins]\n{name} = engine_{name}\n")


def _engine(folder, *args, code=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "engine", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder, timeout=300)


SPECS = '''
    import pluggy

    hookspec = pluggy.HookspecMarker("engine")


    @hookspec(firstresult=True)
    def pick_reference(run):
        """The reference a preference method compares against (firstresult)."""
'''


def test_a_plugin_declares_a_hook_that_another_plugin_answers(tmp_path):
    _distribution(tmp_path, "prefs", SPECS, '''
        from engine import hookimpl

        @hookimpl
        def pick_reference(run):
            return "frozen copy"
    ''')
    asked = _engine(tmp_path, code=(
        "import engine\nrun = engine.Run({'plugins': ['prefs']})\nprint(run.hook.pick_reference(run=run))\n"))
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.strip() == "frozen copy"
    plan = _engine(tmp_path, "plan", "--plugins", "+prefs")
    assert plan.returncode == 0, plan.stderr
    assert any("pick_reference" in line and "prefs" in line for line in plan.stdout.splitlines()), plan.stdout
    listed = _engine(tmp_path, "plugins")
    assert "pick_reference" in listed.stdout and "PROBLEMS" not in listed.stdout, listed.stdout


def test_a_hook_declared_twice_is_one_error_naming_both_modules(tmp_path):
    _distribution(tmp_path, "clash", '''
        import pluggy

        hookspec = pluggy.HookspecMarker("engine")


        @hookspec
        def configure(run):
            """Shadows the kernel's."""
    ''', "")
    said = _engine(tmp_path, "plan")
    assert said.returncode == 2
    assert said.stderr.strip() == ("engine: error: hook 'configure' is declared by engine.hookspecs and by "
                                   "engine_clash.hooks; rename one")
