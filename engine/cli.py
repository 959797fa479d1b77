"""The ``engine`` command: train, evaluate, plan, plugins; more from plugins (hook register_commands).

Exit status: 0 success; 2 bad input (a missing run file, a TOML syntax error, an unknown
plugin, optimizer or key, a wrong type, an output_dir in use by another run, a damaged
checkpoint): one line ``engine: error: ...``, no traceback; 3 the run diverged (nan/inf loss,
gradient norm or weights; nothing non-finite was saved); 130 interrupted. ``--traceback`` (or
``ENGINE_TRACEBACK=1``) also prints the traceback behind an error, e.g. of user code that raised.
An exception raised in an installed plugin's code is one line naming the plugin and the
function; any other exception is a bug of the engine and keeps its traceback.
Only argparse and the config module load before a command runs, so ``engine --help`` is fast,
and ``engine train`` refuses an output_dir that another run holds before the heavy imports.
Other commands and options come from the plugins of the entry-point group ``engine.commands``
(the engine's tooling: migrate, report, plugins new / --check, --accelerate-config), through the
hooks ``register_commands``, ``add_run_arguments`` and ``edit_run_config``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import __version__
from .discovery import command_hooks
from .errors import EngineError


def _add_run_arguments(parser: argparse.ArgumentParser, run_file: bool = True) -> None:
    if run_file:
        parser.add_argument("run_file", nargs="?", metavar="RUN.toml",
                            help="run file; without one, the embedded default run")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.learning_rate=1e-4 (repeatable)")
    parser.add_argument("-p", "--plugins", dest="plugin_edits", action="append", default=[], metavar="EDIT",
                        help="'+name,-name' enables/disables plugins; 'a,b' replaces the list (after "
                             "ENGINE_PLUGINS, whose '-name' entries never load)")
    command_hooks().add_run_arguments(parser=parser)  # e.g. --accelerate-config
    parser.add_argument("--traceback", action="store_true", help=(
        "on an error, also print its traceback (or set ENGINE_TRACEBACK=1)"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description=(
        "A small, plugin-based training engine for PyTorch and Hugging Face models."))
    parser.add_argument("--version", action="version", version=f"engine {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="train a run (default: the embedded tiny run)")
    train.set_defaults(handler=_train)
    _add_run_arguments(train)
    evaluate = commands.add_parser("evaluate", help=(
        "evaluate a run's model on its eval data: metrics as JSON on stdout and in eval_results.json "
        "of the evaluated folder; a job of its own, it writes nothing to the training run's logs"))
    evaluate.set_defaults(handler=_evaluate)
    _add_run_arguments(evaluate)
    evaluate.add_argument("--checkpoint", metavar="PATH", help=(
        "load these weights first: a checkpoint-<step> folder or a final model folder"))
    plan = commands.add_parser("plan", help="show the composed run: plugins, hook order, full config")
    plan.set_defaults(handler=_plan)
    _add_run_arguments(plan)
    plugins = commands.add_parser(
        "plugins", help="list installed plugins, their hooks and names; check a plugin; scaffold a new one",
        usage="engine plugins [RUN.toml] [--set ...] [-p EDIT]\n"
              "       engine plugins --check PATH_OR_MODULE\n"
              "       engine plugins new NAME [--kind KIND] [--dir FOLDER]")
    plugins.add_argument("words", nargs="*", metavar="RUN.toml | new NAME", help=(
        "a run file (its plugins are marked enabled), or 'new NAME' to write a plugin package engine-NAME/"))
    plugins.set_defaults(handler=_plugins)
    _add_run_arguments(plugins, run_file=False)
    command_hooks().register_commands(commands=commands)  # e.g. migrate, report, plugins new / --check
    return parser


def _raw_config(args: argparse.Namespace) -> dict[str, Any]:
    from .config import default_run_mapping, read_run_file

    raw = read_run_file(args.run_file) if args.run_file is not None else default_run_mapping()
    # what the command-line plugins' options changed, (title, lines) each: shown by plan, logged by the others
    args.config_edits = [edit for edit in command_hooks().edit_run_config(raw=raw, args=args) if edit]
    return raw


def _make_run(args: argparse.Namespace) -> Any:
    from .run import Run

    try:
        run = Run(_raw_config(args), overrides=args.sets, plugin_edits=args.plugin_edits)
    except EngineError as exc:
        exc.shown_by_main = True  # every process composes the same run: the main process says it
        raise
    if args.command != "plan":
        import logging

        for title, lines in args.config_edits:
            logging.getLogger("engine").info("%s: %s", title, "; ".join(lines))
    return run


def _train(args: argparse.Namespace) -> int:
    from .config import KernelTrainConfig, apply_overrides
    from .rundir import is_main_process, lock_output_dir

    # lock output_dir now, before torch loads: a folder another run holds is refused at once
    # (the run takes this lock over; a malformed value is left for the run to refuse)
    train = apply_overrides(_raw_config(args), args.sets).get("train", {})
    output_dir = train.get("output_dir", KernelTrainConfig.output_dir) if isinstance(train, dict) else None
    lock = None
    if is_main_process() and isinstance(output_dir, str) and output_dir:
        lock = lock_output_dir(output_dir)
    try:
        _make_run(args).train()
    finally:
        if lock is not None:
            lock.release()
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from .checkpoint import saved_progress
    from .errors import CheckpointError
    from .util import dumps_json, write_json

    run = _make_run(args)
    folder = None
    if args.checkpoint:
        folder = Path(args.checkpoint)
        if not folder.is_dir():
            raise CheckpointError(f"--checkpoint: {args.checkpoint} is not a folder")
        run.weights.check_folder(folder, "--checkpoint")
        # the tokenizer those weights were trained with (when saved there), not one trained again on today's data
        run.tokenizer = run.hook.create_tokenizer(run=run, checkpoint=folder)
    run.setup()
    if folder is not None:
        run.strategy.load_model_weights(run.model, folder)
        run.state.global_step, run.state.epoch = saved_progress(folder)
    # a job of its own: no log_metrics (the training run's metrics.jsonl and trackers are not
    # this job's) and no on_evaluate (nothing trains here)
    evaluated = run.hook.evaluate(run=run, dataset=None, prefix="eval", report=False, in_training=False)
    metrics = {"step": run.state.global_step, **evaluated}
    print(dumps_json(metrics))
    if folder is not None:
        try:
            write_json(folder / "eval_results.json", metrics)
        except OSError as exc:
            logging.getLogger("engine").warning("could not write %s: %s", folder / "eval_results.json", exc.strerror)
    return 0


def _plan(args: argparse.Namespace) -> int:
    text = _make_run(args).plan()
    for title, lines in args.config_edits:
        text += f"\n\n{title} (mapped; --set overrides it):\n" + "\n".join(f"  {line}" for line in lines)
    print(text)
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from .errors import ConfigError

    words = args.words  # `new NAME` and --check: the tooling's (engine.commands)
    if len(words) > 1:
        raise ConfigError(f"engine plugins: one run file at most, got {' '.join(words)} (to scaffold: "
                          "engine plugins new NAME)")
    args.run_file = words[0] if words else None
    return _list_plugins(args)


def _list_plugins(args: argparse.Namespace) -> int:
    from .hookspecs import HOOK_NAMES
    from .plugins import (NO_AUTOLOAD_ENV, autoload_disabled, builtin_specs, describe_installed, inspect_plugin,
                          installed_plugins, load_builtin)

    run = _make_run(args)
    enabled = set(run.config.plugins)
    rows = []
    for plugin in installed_plugins().values():
        if autoload_disabled() and plugin.name not in enabled:
            rows.append(f"{plugin.name:<16} {plugin.distribution} {plugin.version:<10} {'installed':<9}  "
                        f"not imported ({NO_AUTOLOAD_ENV} is set)")
            continue
        try:
            detail = _plugin_detail(*describe_installed(plugin))
        except EngineError as exc:
            detail = f"cannot load: {exc}"
        state = "enabled" if plugin.name in enabled else "installed"
        rows.append(f"{plugin.name:<16} {plugin.distribution} {plugin.version:<10} {state:<9}  {detail}")
    print("installed plugins:" if rows else "installed plugins: (none)")
    print("\n".join("  " + row for row in rows))
    print("builtins (always on unless the run blocks one: plugins = [\"-NAME\"]; enabled plugins replace their names):")
    for name, spec in builtin_specs().items():
        state = "blocked" if name in run.plugin_manager.blocked else "on"
        detail = _plugin_detail(*inspect_plugin(load_builtin(spec), name))
        print(f"  {name:<16} engine {__version__:<10} {state:<9}  {detail}")
    for kind, registry in run.registries.items():
        builtin_names = [n for n, e in registry.entries.items() if e.builtin]
        print(f"  {kind:<10} {', '.join(sorted(builtin_names))}")
    print(f"hooks: {', '.join(HOOK_NAMES)}")
    return 0


def _plugin_detail(hooks: list[str], names: dict[str, list[str]], problems: list[str]) -> str:
    """One plugin's hooks, the names it registers and its problems, for ``engine plugins``."""
    detail = f"hooks: {', '.join(hooks) or '-'}"
    if names:
        detail += "; registers " + "; ".join(f"{kind} {', '.join(v)}" for kind, v in names.items())
    if problems:
        detail += "; PROBLEMS: " + "; ".join(problems)
    return detail


RANK_ERROR_DELAY_S = 2.0


def _launcher_rank() -> int:
    import os

    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def _join_plugin_edits(argv: list[str]) -> list[str]:
    """``--plugins -name`` (or ``-p -name``) as ``--plugins=-name``: argparse would read ``-name`` as an option."""
    joined: list[str] = []
    words = iter(argv)
    for word in words:
        if word in ("--plugins", "-p"):
            value = next(words, None)
            if value is not None and value[:1] in "+-" and not value.startswith("--"):
                joined.append(f"--plugins={value}")
                continue
            joined.append(word)
            word = value
            if word is None:
                continue
        joined.append(word)
    return joined


def _raised_in_plugin(exc: BaseException) -> str | None:
    """``plugin 'x' raised ...`` when the innermost frame of an installed plugin's package raised ``exc``."""
    from pathlib import Path

    from .plugins import installed_plugins
    from .util import describe_exception

    packages = {plugin.value.partition(":")[0].split(".")[0]: plugin.name
                for plugin in installed_plugins().values() if not plugin.value.startswith("engine.")}
    frame, culprit = exc.__traceback__, None
    while frame is not None:
        package = str(frame.tb_frame.f_globals.get("__name__", "")).split(".")[0]
        if package in packages:
            culprit = (packages[package], frame)
        frame = frame.tb_next
    if culprit is None:
        return None
    name, frame = culprit
    code = frame.tb_frame.f_code
    return (f"plugin {name!r} raised {describe_exception(exc)} in {code.co_name} ({Path(code.co_filename).name}, "
            f"line {frame.tb_lineno})")


def main(argv: list[str] | None = None) -> int:
    import os

    try:
        parser = build_parser()
    except EngineError as exc:  # a command-line plugin that does not load
        _report(str(exc))
        return exc.exit_status
    args = parser.parse_args(_join_plugin_edits(sys.argv[1:] if argv is None else list(argv)))
    command = args.handler
    from .logs import quiet_known_noise

    quiet_known_noise()  # every command: what libraries say while they are imported is not the command's output
    show_traceback = getattr(args, "traceback", False) or \
        os.environ.get("ENGINE_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no", "off")
    try:
        return command(args)
    except EngineError as exc:
        if _launcher_rank() and getattr(exc, "shown_by_main", False):
            # the main process prints it: wait, or the launcher, seeing this process end first,
            # could stop the main process before it has said why
            import time

            time.sleep(RANK_ERROR_DELAY_S)
            return exc.exit_status
        if show_traceback:
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
        _report(str(exc))
        return exc.exit_status
    except Exception as exc:  # a plugin's code that raised is the plugin's mistake: one line; else a bug here
        message = None if show_traceback else _raised_in_plugin(exc)
        if message is None:
            raise
        _report(f"{message}; --traceback shows where")
        return 2
    except KeyboardInterrupt:
        print("engine: interrupted", file=sys.stderr)
        return 130


def _report(message: str) -> None:
    """The error line; another process than the main one names its rank, after a pause in which
    the launcher stops it if the main process failed as well (so a shared mistake is said once)."""
    rank = _launcher_rank()
    if rank:
        import time

        time.sleep(RANK_ERROR_DELAY_S)
    print(f"engine: error: {f'[rank {rank}] ' if rank else ''}{message}", file=sys.stderr)
