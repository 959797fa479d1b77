"""The tooling's commands: ``engine migrate``, ``engine report``, ``engine plugins new`` /
``--check``, and ``--accelerate-config`` on the commands that compose a run.

A plugin of the entry-point group ``engine.commands`` (the engine's pyproject.toml), asked by
every ``engine`` command line through ``register_commands``, ``add_run_arguments`` and
``edit_run_config``, and by ``Run(config)`` through ``convert_run_config`` (``Run.hyperparameter_search`` through
``hyperparameter_search``). Only argparse loads here: each command imports its code when it runs, so
``engine --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Any, Callable

from engine import hookimpl
from engine.errors import ConfigError

SIZE_RANGE = (100, 4000)  # pixels per side of a curve: legible, and a figure's memory stays bounded


@hookimpl
def register_commands(commands: Any) -> None:
    _add_plugin_tools(commands.choices["plugins"])
    migrate = commands.add_parser("migrate", help=(
        "write a run file from transformers TrainingArguments (a to_json_string() dump); the report of what "
        "was mapped, and of what has no counterpart, goes to stderr"))
    migrate.add_argument("arguments", metavar="ARGS.json", help=(
        "TrainingArguments.to_json_file() output, an SFTConfig/ModelConfig dump (JSON or YAML), an alignment-handbook "
        "recipe, a .txt of TRL's command-line arguments or an Axolotl YAML"))
    migrate.add_argument("--from", dest="source_kind", choices=["axolotl"], help=(
        "read the file as this tool's config (default: recognised by its keys)"))
    migrate.add_argument("-o", "--output", metavar="RUN.toml", help="write the run file here (default: stdout)")
    migrate.add_argument("--force", action="store_true", help="overwrite an existing -o file")
    migrate.set_defaults(handler=_migrate)
    report = commands.add_parser("report", help=(
        "write report.md, report.html and curves (report-*.png) for a run's output_dir; for several, one "
        "report comparing them (curves overlaid, differing config keys, final metrics); for a sweep folder "
        "(engine sweep), its trials side by side, Optuna's plots and the top trials' curves"))
    report.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help=(
        "a run's train.output_dir, or one sweep folder (it holds sweep.json)"))
    report.add_argument("--out", metavar="DIR", help=(
        "where the report goes (default: the output_dir of one run; the current folder for several)"))
    report.add_argument("--size", default="800x450", metavar="WxH", help="size of each curve in pixels")
    report.add_argument("--no-plots", action="store_true", help="no curves (report.md and report.html only)")
    report.set_defaults(handler=_report)
    _add_sweep(commands)


def _add_sweep(commands: Any) -> None:
    """``engine sweep``'s options (its code, engine/tooling/sweep.py, loads when it runs)."""
    from engine.cli import _add_run_arguments

    sweep = commands.add_parser("sweep", help=(
        "search hyper-parameters: each trial an ordinary run (trial-<n>/ in the sweep folder) with values from "
        "--space; Optuna with its study in the sweep folder, or Ray Tune; a killed sweep continues"))
    _add_run_arguments(sweep)
    sweep.add_argument("--space", required=True, metavar="SPACE.toml", help=(
        "the keys to vary, shaped like the run file: [train] learning_rate = { low = 1e-5, high = 1e-2, "
        "log = true }; settings objective, direction, sampler, seed, pruner (engine/tooling/space.py)"))
    sweep.add_argument("--trials", type=int, default=10, metavar="N", help="trials in all (default 10)")
    sweep.add_argument("--backend", default="optuna", choices=("optuna", "ray", "wandb"), help=(
        "optuna (default: its SQLite study in the sweep folder) or ray (Ray Tune on the cluster RAY_ADDRESS "
        "names, else a local one; its search is random or grid: TPE is Optuna's, pruning is ASHA)"))
    sweep.add_argument("--jobs", type=int, default=1, metavar="K", help="trials running at once (default 1)")
    sweep.add_argument("--trial-processes", type=int, default=1, metavar="P", help=(
        "processes per trial, launched with torchrun (a distributed strategy plugin in the run: ddp, fsdp, ...)"))
    sweep.add_argument("--out", metavar="DIR", help="the sweep folder (default: the run's train.output_dir)")
    sweep.add_argument("--interrupted", default="resume", choices=("resume", "rerun"), help=(
        "a trial that was running when the sweep was killed: resume it from its last checkpoint (default) "
        "or run it again from the start"))
    sweep.set_defaults(handler=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    """``engine sweep``: the search of the backend asked (engine/tooling/sweep.py, sweep_ray.py)."""
    from engine.tooling.sweep import OptunaSearch, run

    if args.backend == "ray":
        from engine.tooling.sweep_ray import RaySearch

        return run(args, RaySearch)
    return run(args, OptunaSearch)


@hookimpl
def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--accelerate-config", metavar="FILE.yaml", help=(
        "map an Accelerate config file (distributed_type, fsdp_config, deepspeed_config, mixed_precision, "
        "...) onto the strategy plugins; engine plan shows the mapping"))


@hookimpl
def edit_run_config(raw: dict[str, Any], args: argparse.Namespace) -> tuple[str, list[str]] | None:
    path = getattr(args, "accelerate_config", None)
    if not path:
        return None
    from engine.tooling import accelerate_config

    edited, mapping = accelerate_config.apply(raw, path)
    raw.clear()
    raw.update(edited)
    return f"accelerate config {mapping.source}", mapping.lines


@hookimpl
def convert_run_config(config: Any) -> dict[str, Any] | None:
    """``Run(training_args)``: Trainer's (or TRL's) arguments converted by ``engine migrate``'s table."""
    if not hasattr(config, "to_json_string"):
        return None
    from engine.tooling.migration import migrate

    migration = migrate(config)
    lost = [what for what, _ in migration.lost] + migration.unknown
    if lost:
        logging.getLogger("engine").warning(
            "Run(%s): not carried over: %s (engine.migrate(args).report() says why)",
            migration.source, "; ".join(lost))
    return migration.mapping


@hookimpl
def hyperparameter_search(run: Any, hp_space: Any, compute_objective: Any, n_trials: int, direction: Any,
                          backend: str | None, hp_name: Any, kwargs: dict[str, Any]) -> Any:
    """``Run.hyperparameter_search``: Trainer's search with optuna or Ray Tune, each trial a run."""
    from engine.tooling import search

    return search.hyperparameter_search(run, hp_space, compute_objective, n_trials, direction, backend, hp_name,
                                        kwargs)


# ---------------------------------------------------------------------------- engine plugins new / --check


def _add_plugin_tools(plugins: argparse.ArgumentParser) -> None:
    """``--check``, ``new NAME --kind --dir`` on ``engine plugins``, which otherwise lists plugins."""
    plugins.add_argument("--check", metavar="PATH_OR_MODULE", help=(
        "inspect a plugin (a project folder, a module file or a module name): entry point, import, hooks "
        "without @hookimpl, hook arguments that do not exist, options schema; exit status 1 on problems"))
    plugins.add_argument("--kind", choices=("optimizer", "loss", "tracker", "callback"), help=(
        "with new: the hooks to start from (default: callback)"))
    plugins.add_argument("--dir", metavar="FOLDER", help="with new: where engine-NAME/ is written (default: here)")
    list_plugins = plugins.get_default("handler")
    plugins.set_defaults(handler=lambda args: _plugins(args, list_plugins))


def _plugins(args: argparse.Namespace, list_plugins: Callable[[argparse.Namespace], int]) -> int:
    words = args.words
    if words[:1] == ["new"]:
        if len(words) != 2 or args.check:
            raise ConfigError("engine plugins new NAME [--kind KIND] [--dir FOLDER]: give one NAME")
        return _new_plugin(words[1], args.kind or "callback", args.dir or ".")
    if args.kind or args.dir:
        raise ConfigError("engine plugins: --kind and --dir go with 'engine plugins new NAME'")
    if args.check and len(words) <= 1:  # more words: the listing refuses them
        return _check_plugin(args.check)
    return list_plugins(args)


def _new_plugin(name: str, kind: str, parent: str) -> int:
    from pathlib import Path

    from engine.tooling.authoring import scaffold

    folder = scaffold(name, kind, Path(parent))
    print(f"wrote {folder}: a {kind} plugin {name!r}. Next:\n"
          f"  pip install -e '{folder}[test]'\n"
          f"  pytest {folder}\n"
          f"  engine plugins --check {folder}\n"
          f"  engine plan --plugins +{name}")
    return 0


def _check_plugin(spec: str) -> int:
    from engine.tooling.authoring import check_plugin

    reports = check_plugin(spec)
    print("\n".join(report.render() for report in reports))
    return 1 if any(report.problems for report in reports) else 0


# ---------------------------------------------------------------------------- engine migrate


def _migrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.tooling.migration import migrate, read_arguments

    output = Path(args.output) if args.output else None
    if output is not None and output.exists() and not args.force:
        raise ConfigError(f"-o {output}: the file exists; pass --force to overwrite it")
    migration = migrate(read_arguments(args.arguments), source=args.arguments, kind=args.source_kind)
    if output is None:
        sys.stdout.write(migration.toml())
    else:
        try:
            output.write_text(migration.toml(), encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"-o {output}: cannot write: {exc.strerror}") from None
    print(migration.report(), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- engine report


def _report(args: argparse.Namespace) -> int:
    from engine.builtin.report_writer import write_report
    from engine.tooling.sweep_report import sweep_in, write_sweep_report

    size = parse_size(args.size)
    out = args.out if args.out is not None or len(args.output_dirs) == 1 else "."
    sweep = sweep_in(args.output_dirs)
    if sweep is not None:
        path = write_sweep_report(sweep, out, size=size, plots=not args.no_plots)
    else:
        path = write_report(args.output_dirs, out, size=size, plots=not args.no_plots)
    print(f"wrote {path} and {path.with_suffix('.html')}")
    return 0


def parse_size(text: str) -> tuple[int, int]:
    """``"800x450"`` -> (800, 450); a ConfigError naming ``--size`` otherwise."""
    low, high = SIZE_RANGE
    sides = re.fullmatch(r"(\d{1,9})x(\d{1,9})", text.lower(), re.ASCII)
    if sides is None or not all(low <= int(side) <= high for side in sides.groups()):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ConfigError(f"--size: expected WIDTHxHEIGHT in pixels, each from {low} to {high} (e.g. 800x450), "
                          f"got {shown!r}")
    return int(sides[1]), int(sides[2])
