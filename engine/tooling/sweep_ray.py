"""``engine sweep ... --backend ray``: Ray Tune runs the trials, each an ordinary run as with Optuna.

Ray Tune drives the search (``SWEEP/ray/tune``: its experiment state), on the cluster ``RAY_ADDRESS``
names, else on a local one bound to 127.0.0.1. Each Ray trial is one engine trial: the actor
(``EngineTrial``) runs ``python -m engine train trial-<n>/run.toml`` through
:meth:`Sweep.run_trial <engine.tooling.sweep.Sweep.run_trial>`; at every evaluation the run (plugin
``sweep_trial``) asks its actor, which reports ``{"objective", "step"}`` to Tune and answers with Tune's
decision (:class:`TuneExchange`). The space maps onto Tune's domains (grid: the grid's combinations in
Optuna's order; tpe and random: Ray's random search, seeded; TPE itself is Optuna's). A pruner other
than "none" becomes Ray's ASHA scheduler on the steps: a trial it stops ends at that evaluation with
status "pruned" in its run.json. The sweep folder must be on a filesystem every Ray node sees.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.layout import RECORD
from engine.tooling.ray_trial import EXCHANGE, POLL_S, TuneExchange, domain, import_ray, make_scheduler
from engine.tooling.sweep import Sweep, _read_json, _trial_line, trial_objective, write_summary

EXPERIMENT = "tune"  # SWEEP/ray/tune: Ray Tune's experiment folder (its state: what a restart restores)
STOP_WAIT_S = 120  # how long a stopped trial may take to record its status before it is killed


def _plain(value: Any) -> Any:
    """numpy scalars (what Tune samples) as Python values: TOML and JSON take those."""
    return value.item() if hasattr(value, "item") else value


def trial_number(trial_id: str, config: dict[str, Any]) -> int:
    """The engine trial a Ray trial is: the grid index it was given, else Tune's counter in its id."""
    return int(config["number"]) if "number" in config else int(trial_id.rsplit("_", 1)[-1])


def trial_params(sweep: Sweep, config: dict[str, Any]) -> dict[str, Any]:
    if sweep.space.sampler == "grid":
        return dict(sweep.grid[int(config["number"])])
    return {key: _plain(config[key]) for key in (parameter.key for parameter in sweep.space.parameters)}


def _trainable() -> type:
    """The Tune trainable class (made on demand: Ray is imported only for --backend ray)."""
    from ray import tune

    class EngineTrial(tune.Trainable):
        """One engine trial in a Ray actor: the run in a process of its own, its evaluations reported."""

        def setup(self, config: dict[str, Any], sweep: Sweep, cwd: str) -> None:
            if os.path.isdir(cwd):
                os.chdir(cwd)  # Tune starts an actor in its own trial folder; the run file's paths are the user's
            self.sweep = sweep
            self.number = trial_number(self.trial_id, config)
            self.params = trial_params(sweep, config)
            exchange = sweep.folder / f"trial-{self.number}" / EXCHANGE
            shutil.rmtree(exchange, ignore_errors=True)  # a trial Tune starts again starts a new exchange
            exchange.mkdir(parents=True)
            self.exchange, self.waiting = TuneExchange(exchange), False
            self.process: Any = None
            self.outcome: tuple[str, Any, int] | None = None
            self.error: BaseException | None = None
            self.thread = threading.Thread(target=self._train, daemon=True)
            self.thread.start()

        def _train(self) -> None:
            try:  # interrupted=True: a trial Tune restarts after a kill resumes from its last checkpoint
                self.outcome = self.sweep.run_trial(self.number, self.params, {"tune": str(self.exchange.folder)},
                                                    interrupted=True, started=self._started)
            except BaseException as exc:
                self.error = exc

        def _started(self, process: Any) -> None:
            self.process = process

        def step(self) -> dict[str, Any]:
            """The run's next evaluation, once it asks (Tune called this again: it goes on), or its end."""
            if self.waiting:
                self.exchange.answer(prune=False)
                self.waiting = False
            while self.thread.is_alive():
                ask = self.exchange.next_ask()
                if ask is not None:
                    self.waiting = True
                    return ask
                time.sleep(POLL_S)
            if self.error is not None:
                raise self.error
            status, objective, step = self.outcome
            return {"done": True, "status": status, "step": step,
                    **({"objective": objective} if objective is not None else {})}

        def cleanup(self) -> None:
            """Tune stopped the trial before its run ended: ASHA on the evaluation the run waits with (it
            records "pruned"), or the sweep stopping (interrupted: it records that and unlocks its folder)."""
            if self.process is None or not self.thread.is_alive():
                return
            if self.waiting:
                self.exchange.answer(prune=True)
            else:
                self.process.send_signal(signal.SIGINT)
            self.thread.join(STOP_WAIT_S)
            if self.thread.is_alive():
                self.process.kill()
                self.thread.join()

    return EngineTrial


def _folder_name(trial: Any) -> str:
    """A Ray trial's folder under SWEEP/ray/tune: named as its engine trial's."""
    return f"trial-{trial_number(trial.trial_id, trial.config)}"


def _result_number(result: Any) -> int:
    return int(Path(result.path).name.removeprefix("trial-"))


class RaySearch:
    """The sweep's trials run by Ray Tune; the summary written as the Optuna backend writes it."""

    def __init__(self, sweep: Sweep):
        self.ray = import_ray()
        self.sweep, self.space = sweep, sweep.space
        self.path = sweep.folder / "ray" / EXPERIMENT

    def run(self) -> dict[str, Any]:
        from ray import tune

        write_summary(self.sweep, [], ray=str(self.path))  # the folder holds this sweep from now: a rerun continues it
        self._connect()
        trainable = tune.with_resources(
            tune.with_parameters(_trainable(), sweep=self.sweep, cwd=os.getcwd()),
            {"cpu": self.sweep.args.trial_processes})
        if tune.Tuner.can_restore(str(self.path)):
            tuner = tune.Tuner.restore(str(self.path), trainable, resume_unfinished=True, resume_errored=False)
        else:
            tuner = tune.Tuner(trainable, param_space=self._param_space(), tune_config=self._tune_config(),
                               run_config=self._run_config())
        results = sorted(tuner.fit(), key=_result_number)
        trials = [self._trial(result) for result in results]
        self._raise_config_error(results)
        return write_summary(self.sweep, trials, ray=str(self.path))

    def _connect(self) -> None:
        """The cluster RAY_ADDRESS names, else a local one (127.0.0.1) with CPUs for --jobs trials at once."""
        ray = self.ray
        if ray.is_initialized():
            return
        quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": True,
                 "logging_level": "ERROR"}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**quiet)
            return
        args = self.sweep.args
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.jobs * args.trial_processes), **quiet)

    def _param_space(self) -> dict[str, Any]:
        from ray import tune

        if self.space.sampler == "grid":  # the grid's combinations by index: Optuna's order, --trials of them
            return {"number": tune.grid_search(list(range(self.sweep.n_trials)))}
        return {parameter.key: domain(parameter) for parameter in self.space.parameters}

    def _tune_config(self) -> Any:
        from ray import tune
        from ray.tune.search.basic_variant import BasicVariantGenerator

        grid = self.space.sampler == "grid"
        search = BasicVariantGenerator(random_state=self.space.seed, max_concurrent=self.sweep.args.jobs)
        scheduler = make_scheduler(self.space, self.sweep._compose({}).config.train.max_steps)
        return tune.TuneConfig(num_samples=1 if grid else self.sweep.n_trials, scheduler=scheduler,
                               search_alg=search, trial_dirname_creator=_folder_name)  # its own max_concurrent

    def _run_config(self) -> Any:
        from ray import tune

        return tune.RunConfig(storage_path=str(self.path.parent), name=EXPERIMENT, verbose=0,
                              failure_config=tune.FailureConfig(max_failures=0),
                              checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False))  # the run's own

    def _trial(self, result: Any) -> dict[str, Any]:
        """A finished Ray trial as sweep.json lists it: its status is its run's (run.json)."""
        number = _result_number(result)
        params = trial_params(self.sweep, result.config)
        folder = self.sweep.folder / f"trial-{number}"
        metrics = result.metrics or {}
        record = _read_json(folder / RECORD) or {}
        status = record.get("status") if record.get("status") in ("finished", "pruned") else "failed"
        objective, step = trial_objective(folder, self.space.objective)
        seconds = metrics.get("time_total_s")
        print(_trial_line(number, params, status, objective, step, self.space, seconds or 0.0), flush=True)
        return {"number": number, "params": params, "status": status,
                "objective": objective if status == "finished" else None, "duration_s": seconds}

    def _raise_config_error(self, results: Any) -> None:
        """A trial refused before it started (bad input every trial shares): one line, as with Optuna."""
        for result in results:
            if isinstance(result.error, ConfigError):
                raise ConfigError(str(result.error).strip().splitlines()[-1].removeprefix("engine: error: "))

