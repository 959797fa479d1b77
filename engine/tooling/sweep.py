"""``engine sweep RUN.toml --space SPACE.toml --trials N``: a hyper-parameter search whose trials are runs.

The sweep folder (``--out``, default the run's ``train.output_dir``)::

    sweep.json     the settings, every trial (parameters, status, objective, last step, duration) and
                   the best trial(s); rewritten after every trial
    space.toml     the search space as given (engine/tooling/space.py)
    study.db       Optuna's study (SQLite: no server)
    trial-<n>/     an ordinary run folder: run.toml (the run file it ran: ``engine train trial-<n>/run.toml``
                   repeats it), run.json, metrics.jsonl, checkpoints, train.log (its console)

Each trial is ``python -m engine train trial-<n>/run.toml`` in a process of its own (``--jobs K`` run K at
once; ``--trial-processes P`` launches each with torchrun, for a distributed strategy plugin). The
plugin ``sweep_trial`` (engine/tooling/trial.py), enabled through ``ENGINE_PLUGINS``, reports each
evaluation to the study, whose pruner may stop the trial: status "pruned" in its run.json.

A sweep killed at any point continues when the same command runs again: finished trials stay, a trial
that was running resumes from its last checkpoint (``--interrupted rerun``: starts over), and the
sampler draws each trial's parameters from its own seed (``seed + trial number``) and the trials before
it, so the sweep ends with the trials an uninterrupted one has.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine.config import apply_overrides, toml_value, to_toml
from engine.errors import ConfigError, MissingDependencyError
from engine.layout import METRICS, PREFIX, RECORD
from engine.util import write_json

SWEEP_FILE, SPACE_FILE, STUDY_FILE, LOCK_FILE = "sweep.json", "space.toml", "study.db", ".sweep.lock"
TRIAL_LOG = "train.log"
STUDY_NAME = "sweep"
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when the process that started it dies


# ---------------------------------------------------------------------------- the settings, checked


class Sweep:
    """What the command line asked, checked before anything is written."""

    def __init__(self, args: argparse.Namespace):
        from engine.cli import _raw_config
        from engine.discovery import builtin_specs
        from engine.tooling.space import read_space

        for name, value in (("--trials", args.trials), ("--jobs", args.jobs),
                            ("--trial-processes", args.trial_processes)):
            if value < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {value}")
        if args.backend == "wandb":
            raise ConfigError("--backend wandb: W&B sweeps need the W&B server (wandb.sweep / wandb.agent), which "
                              "this engine does not drive; use --backend optuna or ray (the wandb plugin still "
                              "logs each trial)")
        self.args = args
        self.space = read_space(args.space)
        self.space_text = Path(args.space).read_text(encoding="utf-8")
        self.base = apply_overrides(_raw_config(args), args.sets, args.plugin_edits, builtin_specs())
        base_run = self._compose({})
        self.folder = Path(args.out or base_run.config.train.output_dir).absolute()
        self.n_trials = args.trials
        if self.space.sampler == "grid":
            self.grid = [dict(zip(self.space.grid(), values)) for values in itertools.product(*self.space.grid().values())]
            self.n_trials = min(self.n_trials, len(self.grid))
            if args.trials > self.n_trials:
                print(f"engine sweep: the grid has {self.n_trials} combinations: {self.n_trials} trials, not "
                      f"{args.trials}", file=sys.stderr)
        self._check(base_run)
        self.settings = {
            "kind": "engine sweep", "backend": args.backend, "run_file": args.run_file, "base": self.base,
            "space": {parameter.key: parameter.as_json() for parameter in self.space.parameters},
            "objective": self.space.objective, "directions": self.space.directions, "sampler": self.space.sampler,
            "seed": self.space.seed, "pruner": self.space.pruner, "trial_processes": args.trial_processes}

    def _compose(self, params: dict[str, Any]) -> Any:
        from engine.run import Run
        from engine.tooling.space import as_overrides

        return Run(apply_overrides(self.base, as_overrides(params)))

    def _check(self, base_run: Any) -> None:
        """Every bound of every parameter composes into a valid run; the objective has what it needs."""
        for parameter in self.space.parameters:
            if parameter.key in ("train.output_dir", "plugins") or parameter.key.startswith("plugins."):
                raise ConfigError(f"{self.args.space}: {parameter.key}: the sweep sets it; vary another key")
            for value in parameter.corners():
                try:
                    self._compose({parameter.key: value})
                except ConfigError as exc:
                    raise ConfigError(f"{Path(self.args.space).name}: {parameter.key} = {toml_value(value)}: "
                                      f"{exc}") from None
        train = base_run.config.train
        if self.space.needs_evaluation and train.eval_strategy == "no":
            objective = ", ".join(self.space.objective or ["eval_loss (Trainer's default objective)"])
            raise ConfigError(f"train.eval_strategy = \"no\": the objective {objective} needs an evaluation in every "
                              "trial; set train.eval_strategy = \"steps\" (with eval data), or objective = "
                              "\"train_loss\" in the space file")
        if self.args.backend == "optuna":
            try:
                self.space.make_pruner()  # its options, checked
            except ImportError:
                raise MissingDependencyError("engine sweep needs optuna: pip install 'engine[sweep]'") from None
        if self.args.backend == "ray" and self.args.interrupted != "resume":
            raise ConfigError("--interrupted: Ray Tune restores its own trials; leave it at resume with --backend ray")
        if self.args.backend == "ray" and len(self.space.directions) > 1:
            raise ConfigError(f"objective: --backend ray optimises one metric (Ray Tune), the space names "
                              f"{len(self.space.directions)}; use --backend optuna for several objectives")
        if self.args.backend == "ray":
            from engine.tooling.ray_trial import make_scheduler

            make_scheduler(self.space, train.max_steps)  # the pruner's options (ASHA's), checked

    def claim_folder(self) -> Any:
        """Lock the sweep folder; a folder with other files, or another sweep's, is refused."""
        import fcntl

        previous = self.folder / SWEEP_FILE
        if previous.is_file():
            try:
                before = json.loads(previous.read_text(encoding="utf-8"))
            except ValueError:
                raise ConfigError(f"--out: {previous} is not valid JSON; restore it or choose another folder") from None
            changed = [key for key, value in self.settings.items() if before.get(key) != json.loads(json.dumps(value))]
            if changed:
                raise ConfigError(f"--out: {self.folder} holds another sweep (its {', '.join(changed)} differ); "
                                  "choose another --out, or run the command that started it")
        elif self.folder.is_dir() and any(self.folder.iterdir()):
            raise ConfigError(f"--out: {self.folder} is not empty and holds no sweep; choose another folder "
                              "(--out, or train.output_dir)")
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = open(self.folder / LOCK_FILE, "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ConfigError(f"--out: {self.folder} is in use by another engine sweep; wait for it, or choose "
                              "another folder") from None
        (self.folder / SPACE_FILE).write_text(self.space_text, encoding="utf-8")
        return lock

    # ------------------------------------------------------------------ a trial

    def trial_run_file(self, number: int, params: dict[str, Any]) -> Path:
        """``trial-<n>/run.toml``: the base run with the trial's values and its own output_dir."""
        from engine.tooling.space import as_overrides

        folder = self.folder / f"trial-{number}"
        folder.mkdir(exist_ok=True)
        raw = apply_overrides(self.base, [*as_overrides(params), f"train.output_dir={toml_value(str(folder))}"])
        path = folder / "run.toml"
        path.write_text(f"# trial {number} of the sweep {self.folder}\n{to_toml(raw)}", encoding="utf-8")
        return path

    def run_trial(self, number: int, params: dict[str, Any], report_to: dict[str, Any] | None,
                  interrupted: bool = False, started: Any = None) -> tuple[str, Any, int]:
        """Train one trial in a process of its own: (its run.json status, its objective, its last step).
        ``started(process)``, if given, is told the trial's process (Ray's actor stops it through that)."""
        from engine.tooling.trial import TRIAL_ENV

        run_file = self.trial_run_file(number, params)
        folder = run_file.parent
        sets = []
        if interrupted and (folder / RECORD).is_file():
            resumable = self.args.interrupted == "resume" and any(folder.glob(f"{PREFIX}*"))
            sets = ["train.resume_from_checkpoint=true"] if resumable else ["train.overwrite_output_dir=true"]
        command = ["-m", "engine", "train", str(run_file), *itertools.chain(*(("--set", item) for item in sets))]
        if self.args.trial_processes > 1:
            command = ["-m", "torch.distributed.run", f"--nproc-per-node={self.args.trial_processes}", *command]
        env = dict(os.environ)
        env["ENGINE_PLUGINS"] = ",".join(filter(None, [env.get("ENGINE_PLUGINS", ""), "sweep_trial"]))
        env[TRIAL_ENV] = json.dumps({**(report_to or {}), "objective": self.space.objective})
        with open(folder / TRIAL_LOG, "ab") as log:
            process = subprocess.Popen([sys.executable, *command], stdout=log, stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=_die_with_parent)
            if started is not None:
                started(process)
            try:
                code = process.wait()
            except BaseException:  # Ctrl-C reaches the trial too (same process group): let it record that
                process.wait()
                raise
        record = _read_json(folder / RECORD) or {}
        status = record.get("status") or ("failed" if code else "finished")
        if code == 2 and not record:  # refused before it started: bad input every trial would share
            raise ConfigError(f"trial {number}: {_last_error(folder / TRIAL_LOG)}")
        objective, step = trial_objective(folder, self.space.objective)
        return status, objective, step


def _die_with_parent() -> None:
    """In the trial's process: die when the sweep does (kill -9 of the sweep leaves no trial behind)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("engine: error: ") for line in lines if line.startswith("engine: error:")]
    return (errors or lines or ["it ended before training (no output)"])[-1]


def trial_objective(folder: Path, names: list[str] | None) -> tuple[Any, int]:
    """The objective of a trial folder's last evaluation (metrics.jsonl), as the trial reported it, and the
    last step logged; (None, step) without one."""
    from engine.tooling.space import metric_key
    from engine.tooling.trial import default_objective

    objective, step = None, 0
    path = folder / METRICS
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    keys = [metric_key(name) for name in names] if names else None
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        step = max(step, row.get("step") or 0)
        if keys is None and any(key.startswith("eval_") for key in row):
            objective = default_objective({key: value for key, value in row.items() if key.startswith("eval_")})
        elif keys is not None and all(key in row for key in keys):
            objective = row[keys[0]] if len(keys) == 1 else [row[key] for key in keys]
    return objective, step


# ---------------------------------------------------------------------------- the search (Optuna)


class OptunaSearch:
    """Trials asked of an Optuna study in ``study.db``, run ``--jobs`` at a time, told as they end."""

    def __init__(self, sweep: Sweep):
        try:
            import optuna
        except ImportError:
            raise MissingDependencyError("engine sweep needs optuna: pip install 'engine[sweep]'") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna, self.sweep, self.space = optuna, sweep, sweep.space
        self.storage = f"sqlite:///{sweep.folder / STUDY_FILE}"
        self.study = optuna.create_study(storage=self.storage, study_name=STUDY_NAME, load_if_exists=True,
                                         directions=self.space.directions, pruner=self.space.make_pruner())
        self.lock = threading.Lock()
        self.failure: BaseException | None = None

    def run(self) -> dict[str, Any]:
        trials = self.study.get_trials(deepcopy=False)
        running = [trial for trial in trials if trial.state == self.optuna.trial.TrialState.RUNNING]
        workers = [threading.Thread(target=self._work, args=(running,), daemon=True)
                   for _ in range(self.sweep.args.jobs)]
        for worker in workers:
            worker.start()
        for worker in workers:
            while worker.is_alive():
                worker.join(0.2)  # join with a timeout: Ctrl-C reaches the main thread
        if self.failure is not None:
            raise self.failure
        return self.write_summary()

    def _work(self, interrupted: list[Any]) -> None:
        try:
            while self.failure is None:
                with self.lock:
                    picked = self._next(interrupted)
                if picked is None:
                    return
                trial, params, again = picked
                report_to = {"storage": self.storage, "study": STUDY_NAME, "trial_id": trial._trial_id,
                             "pruner": self.space.pruner, "prune": len(self.space.directions) == 1}
                started = time.monotonic()
                status, objective, step = self.sweep.run_trial(trial.number, params, report_to, interrupted=again)
                if status == "interrupted":  # Ctrl-C (the trial saw it too): running, for the next start to resume
                    return
                with self.lock:
                    self._tell(trial, status, objective)
                    print(_trial_line(trial.number, params, status, objective, step, self.sweep.space,
                                      time.monotonic() - started), flush=True)
                    self.write_summary()
        except BaseException as exc:
            self.failure = self.failure or exc

    def _next(self, interrupted: list[Any]) -> tuple[Any, dict[str, Any], bool] | None:
        """The next trial: an interrupted one first, else a new one while fewer than --trials exist."""
        optuna = self.optuna
        if interrupted:
            frozen = interrupted.pop(0)
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            self.study.sampler = self.space.make_sampler(self.space.seed + frozen.number)
            return trial, self.space.suggest(trial), True
        number = len(self.study.get_trials(deepcopy=False))
        if number >= self.sweep.n_trials:
            return None
        self.study.sampler = self.space.make_sampler(self.space.seed + number)
        if self.space.sampler == "grid":
            self.study.enqueue_trial(self.sweep.grid[number])
        trial = self.study.ask()
        params = self.space.suggest(trial)
        self.write_summary()
        return trial, params, False

    def write_summary(self) -> dict[str, Any]:
        return write_summary(self.sweep, optuna_trials(self.sweep, self.study), study=STUDY_NAME, storage=self.storage)

    def _tell(self, trial: Any, status: str, objective: Any) -> None:
        states = self.optuna.trial.TrialState
        if status == "finished" and objective is not None:
            self.study.tell(trial, objective)
        elif status == "pruned":
            self.study.tell(trial, state=states.PRUNED)
        else:
            self.study.tell(trial, state=states.FAIL)


_STATUS = {"COMPLETE": "finished", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}


def optuna_trials(sweep: Sweep, study: Any) -> list[dict[str, Any]]:
    """The study's trials as sweep.json lists them."""
    trials = []
    for trial in study.get_trials(deepcopy=False):
        objective = None if trial.values is None else trial.values[0] if len(trial.values) == 1 else list(trial.values)
        duration = (trial.datetime_complete - trial.datetime_start).total_seconds() \
            if trial.datetime_complete and trial.datetime_start else None
        trials.append({"number": trial.number, "params": trial.params, "status": _STATUS[trial.state.name],
                       "objective": objective, "duration_s": duration})
    return trials


def best_trials(trials: list[dict[str, Any]], directions: list[str]) -> list[int]:
    """The best finished trial's number; with several objectives, the Pareto front's."""
    done = [trial for trial in trials if trial["status"] == "finished" and trial["objective"] is not None]
    signs = [1 if direction == "minimize" else -1 for direction in directions]

    def key(trial: dict[str, Any]) -> list[float]:
        values = trial["objective"] if isinstance(trial["objective"], list) else [trial["objective"]]
        return [sign * value for sign, value in zip(signs, values)]

    if len(directions) == 1:
        return [min(done, key=key)["number"]] if done else []
    return [trial["number"] for trial in done
            if not any(all(a <= b for a, b in zip(key(other), key(trial))) and key(other) != key(trial)
                       for other in done)]


def write_summary(sweep: Sweep, trials: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """``sweep.json``: the settings, the trials (each with its folder and last step), the best."""
    for trial in trials:
        trial["folder"] = f"trial-{trial['number']}"
        objective, trial["step"] = trial_objective(sweep.folder / trial["folder"], sweep.space.objective)
        if trial["objective"] is None and trial["status"] == "pruned":
            trial["objective"] = objective  # the last evaluation's, at which it was pruned
    summary = {**sweep.settings, "n_trials": sweep.n_trials, **extra, "trials": trials,
               "best": best_trials(trials, sweep.space.directions)}
    write_json(sweep.folder / SWEEP_FILE, summary)
    return summary


def _trial_line(number: int, params: dict[str, Any], status: str, objective: Any, step: int, space: Any,
                seconds: float) -> str:
    values = ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in params.items())
    name = ", ".join(space.objective or ["objective"])
    result = f"{name} {objective:.6g}" if isinstance(objective, float) else f"{name} {objective}"
    return f"trial {number} [{values}]: {status} at step {step}, {result} ({seconds:.1f} s)"


# ---------------------------------------------------------------------------- the command


def run(args: argparse.Namespace, search: Any) -> int:
    """Check, claim the folder, run ``search(sweep)`` (a backend: ``.run()`` returns sweep.json's summary)."""
    sweep = Sweep(args)
    lock = sweep.claim_folder()
    try:
        summary = search(sweep).run()
    finally:
        lock.close()
    best = [trial for trial in summary["trials"] if trial["number"] in summary["best"]]
    if not best:
        print(f"engine sweep: no trial finished; see {sweep.folder}/trial-*/{TRIAL_LOG}", file=sys.stderr)
        return 1
    for trial in best:
        print(f"best: {trial['folder']} ({', '.join(sweep.space.objective or ['objective'])} {trial['objective']}); "
              f"engine train {sweep.folder / trial['folder'] / 'run.toml'} --set train.output_dir=... repeats it")
    return 0
