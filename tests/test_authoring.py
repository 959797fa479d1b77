"""Plugin authors' tools: ``engine plugins --check`` names each mistake; ``engine plugins new`` writes a
package that installs, passes its own test and runs in a composed run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.tooling.authoring import KINDS, hook_contract
from engine.cli import main
from engine.testing import run_steps, tiny_dataset

ROOT = Path(__file__).resolve().parents[1]


def _check(capfd, spec):
    status = main(["plugins", "--check", str(spec)])
    out, err = capfd.readouterr()
    return status, out, err


def _module(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


# ---------------------------------------------------------------------------- --check


def test_a_module_without_an_entry_point_is_named(tmp_path, capfd):
    path = _module(tmp_path, "engine_gradclip", """
        from engine import hookimpl

        @hookimpl
        def on_step_end(run):
            pass
    """)
    status, out, _ = _check(capfd, path)
    assert status == 1
    assert ("PROBLEM  no installed entry point in group 'engine.plugins' names module 'engine_gradclip', so no run "
            "can enable it: add [project.entry-points.\"engine.plugins\"] gradclip = \"engine_gradclip\"") in out
    assert "ok       hooks: on_step_end" in out and out.rstrip().endswith("1 problem(s)")


def test_a_misspelt_hook_argument_an_unmarked_hook_and_near_names_are_each_named(tmp_path, capfd):
    path = _module(tmp_path, "engine_mistakes", """
        from engine import hookimpl

        @hookimpl
        def compute_loss(run, model, batch, num_items):
            pass

        def on_step_end(run):
            pass

        def on_evaluated(run, metrics):
            pass

        @hookimpl
        def on_epoch_edn(run):
            pass

        def helper(run):  # a plain function of the plugin: not a problem
            pass
    """)
    status, out, _ = _check(capfd, path)
    assert status == 1
    problems = [line.strip().removeprefix("PROBLEM  ") for line in out.splitlines() if "PROBLEM" in line]
    assert ("plugin 'mistakes': compute_loss takes 'num_items' (did you mean 'num_items_in_batch'?), which the hook "
            "does not pass; compute_loss passes (run, model, batch, num_items_in_batch), take any of them") in problems
    assert ("plugin 'mistakes' defines on_step_end without @engine.hookimpl, so it would never be called; mark it "
            "with @hookimpl") in problems
    assert any(p.startswith("on_evaluated looks like hook 'on_evaluate' but is not one") for p in problems)
    assert "helper" not in out


def test_a_module_that_fails_to_import_is_named_with_the_missing_package(tmp_path, capfd):
    path = _module(tmp_path, "engine_needy", "import missing_dependency_xyz\n")
    status, out, _ = _check(capfd, path)
    assert status == 1
    assert ("PROBLEM  plugin 'needy' (not installed) failed to import: missing module 'missing_dependency_xyz'"
            in out)


def test_an_unknown_marked_hook_names_the_closest(tmp_path, capfd):
    path = _module(tmp_path, "engine_typo", """
        from engine import hookimpl

        @hookimpl
        def on_epoch_edn(run):
            pass
    """)
    status, out, _ = _check(capfd, path)
    assert status == 1 and "unknown hook 'on_epoch_edn' (did you mean 'on_epoch_end'?)" in out


def test_an_options_schema_whose_defaults_do_not_fit_is_named(tmp_path, capfd):
    path = _module(tmp_path, "engine_options", """
        from dataclasses import dataclass, field
        from engine import hookimpl, option

        @dataclass
        class Options:
            rank: int = option(0.5, help="projection rank")
            ratio: float = option(2.0, help="share", max=1)
            plain: int = field(default=1)

        @hookimpl
        def plugin_options():
            return Options
    """)
    status, out, _ = _check(capfd, path)
    assert status == 1
    assert "options Options.plain has no help text: declare it with engine.option(default, help=...)" in out
    assert "options Options: the defaults are not valid: options.rank: expected int, got float 0.5" in out


def test_a_project_without_entry_points_or_not_installed_is_named(tmp_path, capfd):
    project = tmp_path / "engine-late"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "engine-late"\nversion = "0.1"\n')
    status, out, _ = _check(capfd, project)
    assert status == 1 and "pyproject.toml declares no entry point in group 'engine.plugins'" in out
    (project / "pyproject.toml").write_text('[project]\nname = "engine-late"\nversion = "0.1"\n'
                                            '[project.entry-points."engine.plugins"]\nlate = "engine_late"\n')
    _module(project, "engine_late", "from engine import hookimpl\n\n@hookimpl\ndef on_train_end(run):\n    pass\n")
    status, out, _ = _check(capfd, project)
    assert status == 1
    assert f"entry point 'late' is declared but not installed: pip install -e {project}" in out
    assert "ok       hooks: on_train_end" in out  # inspected from the folder all the same


@pytest.mark.parametrize("spec", ["engine_lion", str(ROOT / "contrib" / "lion")])
def test_an_installed_plugin_checks_clean(capfd, spec):
    status, out, _ = _check(capfd, spec)
    assert status == 0, out
    assert "registers optimizer lion" in out and "options schema LionOptions" in out
    assert out.rstrip().endswith("no problems found")


@pytest.mark.parametrize("spec, fragment", [
    ("no/such/place.py", "--check: no/such/place.py does not exist (give a project folder, a module file or a "
                         "module name)"),
    ("not_a_module_xyz", "--check: 'not_a_module_xyz' is not a path here and no module 'not_a_module_xyz' is importable"),
])
def test_a_check_of_nothing_is_one_line(capfd, spec, fragment):
    status, out, err = _check(capfd, spec)
    assert status == 2 and err == f"engine: error: {fragment}\n"


# ---------------------------------------------------------------------------- new


def test_each_hook_in_a_scaffold_carries_its_contract():
    text = hook_contract("configure", 4)
    assert text.startswith("Validate the composed run and refuse conflicts, before anything heavy loads.")
    assert "    **When**: once, after the config is composed" in text
    assert text.rstrip().endswith("The whole contract: engine.hookspecs.configure (docs/hooks.md of the engine).")


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory):
    """One package per kind written by ``engine plugins new``, pip-installed into a folder of their
    own on sys.path (not into this environment, which tests running in parallel read), and the
    result of running the four generated test files (one pytest process for all of them)."""
    parent = tmp_path_factory.mktemp("scaffold")
    folders = {}
    for kind in KINDS:
        name = f"scaffolded_{kind}"
        assert main(["plugins", "new", name, "--kind", kind, "--dir", str(parent)]) == 0
        folders[kind] = parent / f"engine-scaffolded-{kind}"
    site = parent / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), *map(str, folders.values())], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    own_tests = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                                *[str(folder / "tests") for folder in folders.values()]],
                               cwd=parent, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)})
    sys.path.insert(0, str(site))  # their distributions (entry points) and modules, for this module's tests
    yield folders, own_tests
    sys.path.remove(str(site))


# each kind's composed run: [train] keys and sections
COMPOSED = {
    "optimizer": ({"optim": "scaffolded_optimizer"}, {"scaffolded_optimizer": {"momentum": 0.5}}),
    "loss": ({}, {"scaffolded_loss": {"label_smoothing": 0.1}}),
    "tracker": ({}, {}),
    "callback": ({"eval_strategy": "steps", "eval_steps": 1}, {"scaffolded_callback": {"target": 1e9}}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_scaffolded_plugin_passes_its_own_test_and_runs_composed(scaffolded, kind, tmp_path, capfd, caplog,
                                                                    monkeypatch):
    folders, own_tests = scaffolded
    folder, name = folders[kind], f"scaffolded_{kind}"
    assert (folder / "pyproject.toml").is_file() and (folder / "README.md").is_file()
    written = (folder / "tests" / f"test_{name}.py").read_text().count("\ndef test_")
    passed = [line for line in own_tests.stdout.splitlines() if line.startswith("PASSED ") and f"test_{name}.py::" in line]
    assert own_tests.returncode == 0 and len(passed) == written >= 2, own_tests.stdout[-3000:]
    status, report, _ = _check(capfd, folder)
    assert status == 0 and report.rstrip().endswith("no problems found"), report
    train, sections = COMPOSED[kind]
    with caplog.at_level("INFO", logger="engine"):
        run = run_steps(2, plugins=[name, "lion"], output_dir=tmp_path, train=train, sections=sections,
                        eval_dataset=tiny_dataset(size=8, seed=1))
    assert run.plugin_manager.installed[name].distribution == f"engine-scaffolded-{kind}"
    assert run.config.plugins == [name, "lion"] and run.state.log_history
    if kind == "optimizer":
        assert type(run.optimizer).__name__ == "SGD" and run.optimizer.param_groups[0]["momentum"] == 0.5
    if kind == "tracker":
        assert (tmp_path / f"{name}.jsonl").read_text().splitlines()[-1] == '{"status": "success"}'
    if kind == "callback":
        assert run.state.global_step == 1  # stopped at the first evaluation
        assert f"stopped at step 1 of 2: {name}: eval_loss" in caplog.text


# (a name, what the error line says)
REFUSED_NAMES = [
    ("train", "a plugin's options are its section [train] of a run file, but [train] is the run file's own section; "
              "pick another name (e.g. 'my_train')"),
    ("data", "[data] is the run file's own section"),
    ("plugins", "plugins is a key of the run file itself"),
    ("required_plugins", "required_plugins is a key of the run file itself"),
    ("report", "report is a builtin plugin (engine.builtin.report)"),
    ("samples", "samples is a builtin plugin (engine.builtin.samples)"),
    ("engine", "engine is the engine's own name"),
    ("lion", "a plugin named 'lion' is installed already (engine-lion); pick another name"),
    ("a" * 300, "the name has 300 characters, more than 40; give a short one"),
    ("gradnoise_", "'gradnoise_' is not a plugin name"),  # engine-gradnoise- is no distribution name
    ("grad__noise", "'grad__noise' is not a plugin name"),
]


@pytest.mark.parametrize("name, fragment", REFUSED_NAMES, ids=[name[:20] for name, _ in REFUSED_NAMES])
def test_a_plugin_name_that_would_collide_or_break_is_one_line(tmp_path, capfd, name, fragment):
    status = main(["plugins", "new", name, "--dir", str(tmp_path)])
    err = capfd.readouterr().err.splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("engine: error: engine plugins new: "), err
    assert fragment in err[0], err[0]
    assert not list(tmp_path.iterdir())  # nothing scaffolded


def test_a_dir_the_os_refuses_is_one_line(tmp_path, capfd):
    parent = tmp_path / ("d" * 300)  # a name longer than the filesystem allows
    assert main(["plugins", "new", "gradnoise", "--dir", str(parent)]) == 2
    err = capfd.readouterr().err.splitlines()
    assert err == [f"engine: error: engine plugins new: cannot write {parent / 'engine-gradnoise'}: File name too long"]


# ---------------------------------------------------------------------------- command plugins


def test_a_command_plugin_adds_a_command_and_an_option_of_the_run_commands(tmp_path):
    """register_commands, add_run_arguments and edit_run_config, answered by a distribution's entry point
    in the group engine.commands, as the engine's own tooling (migrate, report, --accelerate-config) is."""
    _module(tmp_path, "engine_hello", """
        from engine import hookimpl

        @hookimpl
        def register_commands(commands):
            hello = commands.add_parser("hello", help="say hello")
            hello.add_argument("name")
            hello.set_defaults(handler=lambda args: print(f"hello {args.name}") or 0)

        @hookimpl
        def add_run_arguments(parser):
            parser.add_argument("--hello-seed", type=int)

        @hookimpl
        def edit_run_config(raw, args):
            if args.hello_seed is not None:
                raw.setdefault("train", {})["seed"] = args.hello_seed
                return "hello", [f"train.seed = {args.hello_seed}"]
        """)
    metadata = tmp_path / "engine_hello-0.1.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: engine-hello\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text("[engine.commands]\nhello = engine_hello\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}

    def engine(*args):
        return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)

    said = engine("hello", "world")
    assert said.returncode == 0 and said.stdout == "hello world\n", said.stderr
    plan = engine("plan", "--hello-seed", "7")
    assert plan.returncode == 0, plan.stderr
    assert "seed = 7" in plan.stdout
    assert plan.stdout.rstrip().endswith("hello (mapped; --set overrides it):\n  train.seed = 7")
    listed = engine("--help").stdout
    assert "hello" in listed and "migrate" in listed  # the engine's tooling is a command plugin too
