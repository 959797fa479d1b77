"""``engine report SWEEP_DIR``: the report of a hyper-parameter sweep's folder (``engine sweep``).

Like the report of a run (engine/builtin/report_writer.py, whose document and curves it uses), it writes
``report.md`` and the same content as one ``report.html``, with its images as ``report-*.png`` beside them,
from ``sweep.json``, ``study.db`` and the trial folders:

* the sweep: backend, objective(s) and direction(s), how many trials finished / were pruned / failed /
  are running, the run file, the best trial(s); the search space;
* the trials side by side (parameters, objective, status, last step, duration), best first, the best
  marked ★, the unfinished last;
* Optuna's plots of the study: the optimization history (the Pareto front for several objectives) and
  the parameter importances (PED-ANOVA, which needs no scikit-learn);
* the curves of the top three trials overlaid, each labelled with its folder.

What cannot be read (a trial folder gone, a study that cannot be loaded) is a line of the report; a
damaged ``sweep.json`` is one ConfigError line naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from engine.builtin.report_writer import (DEFAULT_SIZE, NO_PLOTS, Document, RunFiles, _check_types, _curves_section,
                                          _make_folder, _read_json, _write, _write_file)
from engine.errors import ConfigError
from engine.tooling.sweep import SPACE_FILE, STUDY_FILE, STUDY_NAME, SWEEP_FILE

TOP = 3  # trials whose curves are overlaid
BEST_MARK = "★"
SWEEP_TYPES = {"backend": str, "run_file": str, "space": dict, "objective": list[str], "directions": list[str],
               "trials": list[dict], "best": list[int], "study": str}
TRIAL_REQUIRED = {"number": int, "folder": str, "params": dict, "status": str}
TRIAL_TYPES = {"objective": (int, float, list), "step": int, "duration_s": (int, float)}
STATUSES = ("finished", "pruned", "failed", "running", "waiting")
# Optuna's plots: name -> title (report-<name>.png)
STUDY_PLOTS = {"history": "optimization history", "pareto": "Pareto front", "importances": "parameter importances"}


def sweep_in(folders: list[str | Path]) -> Path | None:
    """The sweep folder (one holding sweep.json) among ``folders``, None when there is none; a sweep
    folder given with other folders is refused (its report is of the sweep alone)."""
    sweeps = [Path(folder) for folder in folders if (Path(folder) / SWEEP_FILE).is_file()]
    if not sweeps:
        return None
    if len(folders) > 1:
        raise ConfigError(f"report: {sweeps[0]} is a sweep folder ({SWEEP_FILE}): report it alone, `engine report "
                          f"{sweeps[0]}`, or compare its trials: `engine report {sweeps[0] / 'trial-0'} "
                          f"{sweeps[0] / 'trial-1'}`")
    return sweeps[0]


@dataclass
class SweepFiles:
    """A sweep folder as the report reads it: sweep.json, checked."""

    folder: Path
    settings: dict[str, Any]
    trials: list[dict[str, Any]]

    @classmethod
    def read(cls, folder: str | Path) -> SweepFiles:
        folder = Path(folder)
        path = folder / SWEEP_FILE
        settings = _read_json(path, SWEEP_TYPES)
        _check_types(settings, {"trials": list[dict]}, str(path), required=True)
        for index, trial in enumerate(settings["trials"]):
            _check_types(trial, TRIAL_REQUIRED, f"{path} trials[{index}]", required=True)
            _check_types(trial, TRIAL_TYPES, f"{path} trials[{index}]")
        return cls(folder, settings, settings["trials"])

    @property
    def objective_names(self) -> list[str]:
        return self.settings.get("objective") or ["objective"]

    @property
    def directions(self) -> list[str]:
        return self.settings.get("directions") or ["minimize"]

    @property
    def best(self) -> list[int]:
        return self.settings.get("best") or []

    @property
    def parameters(self) -> list[str]:
        """The keys of the search space, then any other a trial was given."""
        keys = dict.fromkeys(self.settings.get("space") or {})
        for trial in self.trials:
            keys.update(dict.fromkeys(trial["params"]))
        return list(keys)

    def values(self, trial: dict[str, Any]) -> list[Any]:
        """The trial's objective value(s), one per objective name (None where there is none)."""
        objective = trial.get("objective")
        values = objective if isinstance(objective, list) else [objective]
        return [*values, *[None] * len(self.objective_names)][:len(self.objective_names)]

    def ranked(self) -> list[dict[str, Any]]:
        """The trials best first: the best, then the finished by the first objective, then the unfinished
        (by number)."""
        sign = 1 if self.directions[0] == "minimize" else -1

        def rank(trial: dict[str, Any]) -> tuple[int, float, int]:
            first = self.values(trial)[0]
            if trial["status"] != "finished" or not isinstance(first, (int, float)):
                return 2, 0.0, trial["number"]
            return (0 if trial["number"] in self.best else 1), sign * first, trial["number"]

        return sorted(self.trials, key=rank)

    def top(self) -> list[dict[str, Any]]:
        """The best :data:`TOP` finished trials with an objective."""
        return [trial for trial in self.ranked() if trial["status"] == "finished"
                and isinstance(self.values(trial)[0], (int, float))][:TOP]

    def top_runs(self) -> tuple[list[RunFiles], list[str]]:
        """The top trials' folders, each named by its folder, and why any of them could not be read."""
        runs, unread = [], []
        for trial in self.top():
            try:
                runs.append(RunFiles.read(self.folder / trial["folder"], name=trial["folder"]))
            except ConfigError as exc:
                unread.append(str(exc))
        return runs, unread


def _objective_text(sweep: SweepFiles) -> str:
    directions = sweep.directions
    if not sweep.settings.get("objective"):
        return (f"Trainer's default objective (eval_loss; the sum of the metrics with compute_metrics), "
                f"{directions[0]}")
    return ", ".join(f"{name} ({direction})" for name, direction in zip(sweep.objective_names, directions))


def _sweep_section(doc: Document, sweep: SweepFiles) -> None:
    doc.heading("The sweep")
    settings, trials = sweep.settings, sweep.trials
    counts = {status: sum(trial["status"] == status for trial in trials) for status in STATUSES}
    backend = settings.get("backend", "?")
    lines = [f"sweep folder: `{sweep.folder}`",
             f"backend: {backend}" + (f" (study `{settings.get('study', STUDY_NAME)}` in `{STUDY_FILE}`)"
                                      if backend == "optuna" else ""),
             f"objective: {_objective_text(sweep)}",
             f"trials: {len(trials)} of {settings.get('n_trials', '?')}: " + ", ".join(
                 f"{counts[status]} {status}" for status in STATUSES if counts[status] or status != "waiting"),
             f"run file: `{settings['run_file']}`" if settings.get("run_file") else "run file: the embedded default run"]
    if settings.get("sampler"):
        seed = settings.get("seed")
        lines.append(f"sampler: {settings['sampler']}" + (f" (seed {seed})" if seed is not None else "")
                     + f"; pruner: {_pruner_text(settings.get('pruner'))}")
    by_number = {trial["number"]: trial for trial in trials}
    for number in sweep.best:
        trial = by_number.get(number)
        if trial is not None:
            values = ", ".join(f"{name} {_value(value)}" for name, value in zip(sweep.objective_names,
                                                                                  sweep.values(trial)))
            lines.append(f"best: {trial['folder']} ({values}); `engine train {sweep.folder / trial['folder']}"
                         "/run.toml --set train.output_dir=NEW` repeats it")
    if not sweep.best:
        lines.append("best: none yet (no trial finished)")
    doc.bullets(lines)
    space = settings.get("space") or {}
    if space:
        doc.paragraph(f"The search space (`{SPACE_FILE}`):")
        doc.table(["key", "type", "range or values", "log"],
                  [[key, spec.get("type"), spec.get("values", [spec.get("low"), spec.get("high")]), spec.get("log")]
                   for key, spec in space.items() if isinstance(spec, dict)])


def _pruner_text(pruner: Any) -> str:
    """``{"type": "median", "n_warmup_steps": 2}`` -> ``median (n_warmup_steps=2)``."""
    if not isinstance(pruner, dict):
        return str(pruner) if pruner else "none"
    settings = ", ".join(f"{key}={value}" for key, value in pruner.items() if key != "type")
    return f"{pruner.get('type', '?')}" + (f" ({settings})" if settings else "")


def _value(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value) if value is not None else "-"


def _trials_section(doc: Document, sweep: SweepFiles) -> None:
    doc.heading("Trials")
    if not sweep.trials:
        doc.paragraph("No trial yet.")
        return
    keys = sweep.parameters
    doc.paragraph(f"Best first ({BEST_MARK}: the best" + (" trials, the Pareto front" if len(sweep.directions) > 1
                                                          else " trial") + "); the unfinished last.")
    rows = []
    for trial in sweep.ranked():
        duration = trial.get("duration_s")
        rows.append([BEST_MARK if trial["number"] in sweep.best else "", trial["number"], trial["folder"],
                     *(trial["params"].get(key) for key in keys), *map(_value, sweep.values(trial)),
                     trial["status"], trial.get("step"), f"{duration:.1f} s" if duration is not None else None])
    doc.table(["best", "trial", "folder", *keys, *sweep.objective_names, "status", "step", "duration"], rows)
    missing = [trial["folder"] for trial in sweep.trials
               if trial["status"] not in ("running", "waiting") and not (sweep.folder / trial["folder"]).is_dir()]
    if missing:
        doc.paragraph(f"Not in `{sweep.folder}` (moved or deleted?): " + ", ".join(f"`{name}/`" for name in missing)
                      + f"; their rows are from `{SWEEP_FILE}`.")


def _study_section(doc: Document, sweep: SweepFiles, out: Path, size: tuple[int, int], plots: bool) -> None:
    """Optuna's plots of study.db as report-<name>.png, or a line saying why there are none."""
    doc.heading("The study")
    path = sweep.folder / STUDY_FILE
    if not plots:
        doc.paragraph(f"Plots are off (--no-plots); `engine report {sweep.folder}` draws them.")
        return
    if not path.is_file():
        doc.paragraph(f"No `{STUDY_FILE}` here (backend {sweep.settings.get('backend', '?')}), so no Optuna plots.")
        return
    try:
        import matplotlib
        import optuna
        import optuna.visualization.matplotlib as optuna_plots
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError as exc:
        doc.paragraph(NO_PLOTS.format(dirs=sweep.folder) if exc.name == "matplotlib" else
                      "Optuna's plots need optuna: `pip install 'engine[sweep]'`, then `engine report "
                      f"{sweep.folder}` draws them.")
        return
    study_name = sweep.settings.get("study", STUDY_NAME)
    try:
        study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{path}")
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    except KeyError:
        doc.paragraph(f"No Optuna plots: `{path}` holds no study named `{study_name}` (the study of {SWEEP_FILE}).")
        return
    except (RuntimeError, optuna.exceptions.OptunaError, SQLAlchemyError) as exc:
        doc.paragraph(f"No Optuna plots: cannot read the study in `{path}`: {str(exc).splitlines()[0]}")
        return
    if len(complete) < 2:
        doc.paragraph(f"No Optuna plots: they need 2 or more completed trials; the study has {len(complete)}.")
        return
    names = sweep.objective_names
    draw = partial(_study_plot, doc, out, size)
    parameters = {key for trial in complete for key in trial.params}
    with warnings.catch_warnings(), matplotlib.rc_context():  # Optuna's plots: experimental, and a global style
        warnings.simplefilter("ignore")
        if len(study.directions) > 1:
            draw("pareto", lambda: optuna_plots.plot_pareto_front(study, target_names=names))
            doc.paragraph("No parameter importances: they are computed for a study with one objective.")
            return
        draw("history", lambda: optuna_plots.plot_optimization_history(study, target_name=names[0]))
        if len(parameters) < 2:
            doc.paragraph(f"No parameter importances: they rank 2 or more parameters; the trials vary "
                          f"{len(parameters)}.")
            return
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        importances = optuna.importance.get_param_importances(study, evaluator=evaluator)
        doc.paragraph(f"Parameter importances (PED-ANOVA, over {len(complete)} completed trials):")
        doc.table(["parameter", "importance"], [[key, value] for key, value in importances.items()])
        draw("importances", lambda: optuna_plots.plot_param_importances(study, evaluator=evaluator,
                                                                        target_name=names[0]))


def _study_plot(doc: Document, out: Path, size: tuple[int, int], name: str, plot: Callable[[], Any]) -> None:
    """Save the figure of one of Optuna's plots (``plot()`` returns its axes) as report-<name>.png."""
    from matplotlib import pyplot  # Optuna draws with pyplot: its figures are closed here

    try:
        figure = plot().figure
    except ValueError as exc:
        doc.paragraph(f"No {STUDY_PLOTS[name]}: {exc}")
        return
    try:
        figure.set_size_inches(size[0] / 100, size[1] / 100)
        figure.tight_layout()
        image = out / f"report-{name}.png"
        _write_file(image, lambda tmp: figure.savefig(tmp, format="png", dpi=100))
    finally:
        pyplot.close(figure)
    doc.image(image, STUDY_PLOTS[name])


def _top_section(doc: Document, sweep: SweepFiles, out: Path, size: tuple[int, int], plots: bool) -> None:
    """The curves of the top trials overlaid, each labelled with its folder."""
    doc.heading("Top trials")
    runs, unread = sweep.top_runs()
    if runs:
        doc.paragraph(f"The curves of the best {len(runs)} finished trial(s): " + ", ".join(run.name for run in runs)
                      + ".")
    else:
        doc.paragraph("No curves: no top trial could be read." if unread else "No finished trial to draw.")
    if unread:
        doc.bullets(unread)
    if runs:
        _curves_section(doc, runs, out, size, plots, str(sweep.folder))


def write_sweep_report(folder: str | Path, out: str | Path | None = None, *, size: tuple[int, int] = DEFAULT_SIZE,
                       plots: bool = True) -> Path:
    """Write report.md, report.html and report-*.png into ``out`` (default: the sweep folder) for the sweep
    in ``folder``; returns report.md's path."""
    sweep = SweepFiles.read(folder)
    out = Path(out) if out is not None else sweep.folder
    _make_folder(out)
    doc = Document(f"Sweep report: {sweep.folder.resolve().name}")
    _sweep_section(doc, sweep)
    _trials_section(doc, sweep)
    _study_section(doc, sweep, out, size, plots)
    _top_section(doc, sweep, out, size, plots)
    return _write(out, doc)
