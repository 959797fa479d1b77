"""Tools for plugin authors: ``engine plugins --check`` and ``engine plugins new``.

:func:`check_plugin` inspects a plugin the way a run would load it and names every mistake that
would make the engine ignore or refuse it: a missing or stale entry point, an import that fails,
a function named like a hook without ``@hookimpl`` (or named almost like one), a hook argument
that the hook does not pass (with the closest real names), an unknown hook, a register hook that
raises, an options schema whose defaults do not fit their own types or ranges.

:func:`scaffold` writes a new plugin package for one kind (optimizer, loss, tracker, callback)
from the templates in ``engine/tooling/scaffold/``: pyproject with the entry point, the hook module with
each hook's contract as its docstring, an options schema, a README and a test that passes as
generated.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import string
import sys
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from engine import __version__, hookspecs
from engine.config import CORE_SECTIONS, TOP_LEVEL_KEYS
from engine.errors import ConfigError, PluginError
from engine.plugins import ENTRY_POINT_GROUP, InstalledPlugin, inspect_plugin, installed_plugins

# ---------------------------------------------------------------------------- engine plugins --check


@dataclass
class CheckReport:
    """What ``engine plugins --check`` found: lines that passed and problems, per plugin."""

    subject: str
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def ok(self, text: str) -> None:
        self.lines.append(f"  ok       {text}")

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.lines.append(f"  PROBLEM  {text}")

    def render(self) -> str:
        verdict = f"{len(self.problems)} problem(s)" if self.problems else "no problems found"
        return "\n".join([f"checking {self.subject}", *self.lines, verdict])


@contextmanager
def _on_sys_path(folder: Path | None) -> Iterator[None]:
    if folder is None:
        yield
        return
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def _declared_entry_points(project: Path) -> tuple[str, dict[str, str]]:
    """(distribution name, {entry name: value}) declared by ``project/pyproject.toml``."""
    try:
        data = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--check: cannot read {project / 'pyproject.toml'}: {exc}") from None
    meta = data.get("project", {})
    return meta.get("name", "?"), dict(meta.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}))


def _module_folder(project: Path, module: str) -> Path:
    """The folder to import ``module`` from when ``project`` is not installed (src/ layout too)."""
    top = module.split(".")[0]
    for root in (project, project / "src"):
        if (root / top).is_dir() or (root / f"{top}.py").is_file():
            return root
    return project


def _targets(spec: str) -> tuple[str, list[tuple[InstalledPlugin, Path | None]], list[str]]:
    """What ``spec`` names: (subject, [(the plugin as an entry point, folder to import from)], problems).

    ``spec`` is a project folder (with pyproject.toml), a plugin module file or package folder,
    or an importable module name (``pkg.mod`` or ``pkg.mod:Class``).
    """
    installed = installed_plugins()
    by_module = {}
    for plugin in installed.values():
        by_module.setdefault(plugin.value.partition(":")[0], []).append(plugin)
    path = Path(spec)
    problems: list[str] = []
    if path.is_dir() and (path / "pyproject.toml").is_file():
        distribution, declared = _declared_entry_points(path)
        subject = f"project {path} ({distribution})"
        if not declared:
            problems.append(f"pyproject.toml declares no entry point in group {ENTRY_POINT_GROUP!r}, so no run can "
                            f"enable it: add [project.entry-points.\"{ENTRY_POINT_GROUP}\"] NAME = \"your_module\"")
        targets = []
        for name, value in declared.items():
            current = installed.get(name)
            if current is None:
                problems.append(f"entry point {name!r} is declared but not installed: pip install -e {path}")
            elif current.value != value:
                problems.append(f"entry point {name!r} is installed as {current.value!r} ({current.distribution} "
                                f"{current.version}) but pyproject.toml says {value!r}: reinstall (pip install -e {path})")
            targets.append((InstalledPlugin(name, value, distribution, "?"),
                            _module_folder(path, value.partition(":")[0])))
        return subject, targets, problems
    if path.suffix == ".py" and path.is_file() or path.is_dir() and (path / "__init__.py").is_file():
        module = path.stem if path.suffix == ".py" else path.name
        folder = path.resolve().parent
    elif path.exists():
        raise ConfigError(f"--check: {spec} is neither a project folder (with pyproject.toml), a .py file nor a "
                          "package folder")
    elif re.fullmatch(r"[A-Za-z_][\w.]*(:[\w.]+)?", spec):
        module, folder = spec.partition(":")[0], None
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ConfigError(f"--check: {spec!r} is not a path here and no module {module.split('.')[0]!r} is "
                              "importable")
    else:
        raise ConfigError(f"--check: {spec} does not exist (give a project folder, a module file or a module name)")
    entry_points = by_module.get(module, [])
    if not entry_points:
        name = module.removeprefix("engine_")
        problems.append(f"no installed entry point in group {ENTRY_POINT_GROUP!r} names module {module!r}, so no run "
                        f"can enable it: add [project.entry-points.\"{ENTRY_POINT_GROUP}\"] {name} = \"{module}\" to its "
                        "pyproject.toml and install it (pip install -e .)")
        value = spec if ":" in spec else module
        return f"module {module}", [(InstalledPlugin(name, value, "not installed", "?"), folder)], problems
    return f"module {module}", [(plugin, folder) for plugin in entry_points], problems


def _near_hook_names(target: Any) -> list[str]:
    """Functions named almost like a hook (``on_step_ends``) and not marked: likely typos."""
    found = []
    for attribute, value in vars(target if inspect.ismodule(target) else type(target)).items():
        if attribute.startswith("_") or attribute in hookspecs.HOOK_NAMES or not callable(value):
            continue
        if isinstance(value, type) or getattr(value, "engine_impl", None) is not None:
            continue
        if inspect.ismodule(target) and getattr(value, "__module__", None) != target.__name__:
            continue  # imported helpers are not the plugin's own functions
        close = difflib.get_close_matches(attribute, hookspecs.HOOK_NAMES, n=1, cutoff=0.85)
        if close:
            found.append(f"{attribute} looks like hook {close[0]!r} but is not one (a typo?); rename it and mark it "
                         "@hookimpl, or rename it away from the hook's name")
    return found


def _check_options(report: CheckReport, plugin: Any, name: str) -> None:
    from engine.config import from_mapping, to_mapping

    impl = getattr(plugin, "plugin_options", None)
    if impl is None or getattr(impl, "engine_impl", None) is None:
        report.ok("no options schema (the plugin takes no [section])")
        return
    try:
        schema = impl()
    except Exception as exc:
        report.problem(f"plugin_options raised {type(exc).__name__}: {exc}")
        return
    if schema is None:
        report.ok("plugin_options returns None (the plugin takes no [section])")
        return
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        report.problem(f"plugin_options returned {schema!r}: return a @dataclass class (fields made with "
                       "engine.option), or None")
        return
    fields = dataclasses.fields(schema)
    for item in fields:
        if "help" not in item.metadata:
            report.problem(f"options {schema.__name__}.{item.name} has no help text: declare it with "
                           "engine.option(default, help=...) (engine plan shows it)")
    try:
        defaults = from_mapping(schema, {}, name)
        from_mapping(schema, to_mapping(defaults), name)  # the defaults fit their own types and ranges
    except ConfigError as exc:
        report.problem(f"options {schema.__name__}: the defaults are not valid: {exc}")
        return
    report.ok(f"options schema {schema.__name__} ({len(fields)} keys, defaults valid): the [{name}] section")


def check_plugin(spec: str) -> list[CheckReport]:
    """Inspect the plugin(s) that ``spec`` names; one report per plugin (see the module docstring)."""
    subject, targets, problems = _targets(spec)
    report = CheckReport(subject)
    for problem in problems:
        report.problem(problem)
    reports = [report]
    for target, folder in targets:
        name, value = target.name, target.value
        plugin_report = report if len(targets) == 1 else CheckReport(f"plugin {name!r} ({value})")
        if plugin_report is not report:
            reports.append(plugin_report)
        with _on_sys_path(folder):
            try:
                plugin = target.load()
            except PluginError as exc:
                plugin_report.problem(str(exc))
                continue
        plugin_report.ok(f"{value} imports")
        hooks, names, hook_problems = inspect_plugin(plugin, name)
        for problem in [*hook_problems, *_near_hook_names(plugin)]:
            plugin_report.problem(problem)
        if hooks:
            plugin_report.ok(f"hooks: {', '.join(hooks)}")
        elif not hook_problems:
            plugin_report.problem("implements no hook: mark the hook functions with @engine.hookimpl")
        for kind, registered in names.items():
            plugin_report.ok(f"registers {kind} {', '.join(registered)}")
        _check_options(plugin_report, plugin, name)
    return reports


# ---------------------------------------------------------------------------- engine plugins new


KINDS = {
    "optimizer": "an optimizer registered under a train.optim name",
    "loss": "a compute_loss implementation",
    "tracker": "a logger of metrics and the config (like TensorBoard or MLflow)",
    "callback": "lifecycle hooks that watch the run and may stop it",
}
TEMPLATES = Path(__file__).with_name("scaffold")
# kinds whose plugin keeps per-run state: the entry point names a class (one instance per run)
CLASS_KINDS = {"tracker": "Tracker", "callback": "Callback"}
# hooks each kind's module implements: their contracts become the functions' docstrings
KIND_HOOKS = {
    "optimizer": ("plugin_options", "configure", "register_optimizers"),
    "loss": ("plugin_options", "configure", "compute_loss"),
    "tracker": ("plugin_options", "log_hyperparams", "log_metrics", "log_finish"),
    "callback": ("plugin_options", "configure", "on_evaluate", "checkpoint_state", "load_checkpoint_state"),
}


def hook_contract(hook_name: str, indent: int) -> str:
    """The first lines of a hookspec's docstring, to head an implementation: what it does,
    **When** it fires and how results **Combine**, and where the rest is."""
    doc = inspect.cleandoc(getattr(hookspecs, hook_name).__doc__)
    paragraphs = doc.split("\n\n")
    keep = [paragraphs[0], *[p for p in paragraphs[1:] if p.startswith("**When**")]]
    text = "\n\n".join(keep) + f"\n\nThe whole contract: engine.hookspecs.{hook_name} (docs/hooks.md of the engine)."
    pad = " " * indent
    return "\n".join(pad + line if line else "" for line in text.splitlines()).lstrip()


# a Python identifier that makes a valid distribution name (engine-<name>: no trailing or double "-")
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
MAX_NAME_LENGTH = 40  # it names a [section], a module, a distribution and files


def _taken_by(name: str) -> str | None:
    """What a run already calls ``name``, so that a plugin's [name] section would collide with it."""
    from engine import builtin

    if name in CORE_SECTIONS:
        return f"[{name}] is the run file's own section"
    if name in TOP_LEVEL_KEYS:
        return f"{name} is a key of the run file itself"
    if name in {module.name for module in pkgutil.iter_modules(builtin.__path__)}:
        return f"{name} is a builtin plugin (engine.builtin.{name})"
    if name in ("engine", "builtin"):
        return f"{name} is the engine's own name"
    return None


def _check_name(name: str) -> None:
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigError(f"engine plugins new: the name has {len(name)} characters, more than {MAX_NAME_LENGTH}; "
                          "give a short one (it names the [section], the module engine_<name> and the distribution)")
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"engine plugins new: {name!r} is not a plugin name; use lower-case letters and digits, "
                          "starting with a letter, words joined by single underscores (it names the entry point, "
                          "the [section], the module engine_<name> and the distribution engine-<name>)")
    taken = _taken_by(name)
    if taken is not None:
        raise ConfigError(f"engine plugins new: a plugin's options are its section [{name}] of a run file, but "
                          f"{taken}; pick another name (e.g. 'my_{name}')")
    if name in installed_plugins():
        raise ConfigError(f"engine plugins new: a plugin named {name!r} is installed already "
                          f"({installed_plugins()[name].distribution}); pick another name")


def scaffold(name: str, kind: str, parent: Path) -> Path:
    """Write the plugin package ``parent/engine-<name>`` for ``kind``; returns its folder."""
    _check_name(name)
    if kind not in KINDS:
        raise ConfigError(f"engine plugins new --kind: {kind!r} is not a kind; choose one of {', '.join(KINDS)}")
    distribution = f"engine-{name.replace('_', '-')}"
    folder = parent / distribution
    if os.path.exists(folder):  # False for a path the OS refuses (too long): writing says why
        raise ConfigError(f"engine plugins new: {folder} exists already; remove it or choose --dir")
    class_name = "".join(part.title() for part in name.split("_")) + CLASS_KINDS.get(kind, "")
    values = {
        "name": name, "kind": kind, "module": f"engine_{name}", "distribution": distribution,
        "engine_version": __version__, "class_name": class_name.removesuffix(CLASS_KINDS.get(kind, "")),
        "entry_point": f"engine_{name}:{class_name}" if kind in CLASS_KINDS else f"engine_{name}",
        "description": KINDS[kind],
        # a class's hooks are methods: their docstrings sit one level deeper
        **{f"doc_{hook}": hook_contract(hook, 8 if kind in CLASS_KINDS else 4) for hook in KIND_HOOKS[kind]},
    }
    files = {
        "pyproject.toml": TEMPLATES / "pyproject.toml.tmpl",
        "README.md": TEMPLATES / "README.md.tmpl",
        f"engine_{name}/__init__.py": TEMPLATES / kind / "plugin.py.tmpl",
        f"tests/test_{name}.py": TEMPLATES / kind / "test.py.tmpl",
    }
    try:
        for target, template in files.items():
            path = folder / target
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(string.Template(template.read_text(encoding="utf-8")).substitute(values), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"engine plugins new: cannot write {folder}: {exc.strerror}") from None
    return folder
