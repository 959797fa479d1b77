"""The Ray Tune side of an ``engine sweep --backend ray`` trial, apart from the sweep (engine/tooling/sweep_ray.py)
so that a trial's run (plugin ``sweep_trial``) and the sweep's checks reach it without the sweep:
:class:`TuneExchange` (a run and its Ray actor at each evaluation), :func:`make_scheduler` (the space's
pruner as ASHA) and :func:`domain` (a space parameter as a Tune domain).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, MissingDependencyError
from engine.util import write_json

POLL_S = 0.1  # how often a trial's run and its actor look for each other's file
EXCHANGE = ".tune"  # trial-<n>/.tune: the run's reports and Tune's answers (TuneExchange)
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's nodes listen on 127.0.0.1, as on macOS
ASHA_OPTIONS = ("grace_period", "reduction_factor", "brackets", "max_t")
RUN_BY_EPOCHS_MAX_T = 10**9  # ASHA's max_t for a run without max_steps: its rungs go on


def import_ray() -> Any:
    """Ray, imported the sweep's way: a local cluster on loopback only (Ray reads that at import), its
    classic console reporter (silent at verbose=0)."""
    if not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault(LOOPBACK_ONLY, "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    try:
        import ray.tune
    except ImportError:
        raise MissingDependencyError("engine sweep --backend ray needs Ray Tune: pip install 'engine[ray]'") from None
    return ray


def domain(parameter: Any) -> Any:
    """A space parameter as a Ray Tune domain (an int's high is inclusive, as in Optuna)."""
    from ray import tune

    if parameter.type == "categorical":
        return tune.choice(parameter.values)
    if parameter.type == "int":
        if parameter.log:
            return tune.lograndint(parameter.low, parameter.high + 1)
        if parameter.step:
            return tune.qrandint(parameter.low, parameter.high, parameter.step)  # both ends included
        return tune.randint(parameter.low, parameter.high + 1)
    if parameter.log:
        return tune.loguniform(parameter.low, parameter.high)
    if parameter.step:
        return tune.quniform(parameter.low, parameter.high, parameter.step)
    return tune.uniform(parameter.low, parameter.high)


class TuneExchange:
    """How a trial's run and its Ray actor agree at each evaluation, through files in ``trial-<n>/.tune``:
    the run writes ``ask-<k>.json`` (its objective and step) and waits; the actor reports it to Tune and
    writes ``answer-<k>.json`` once Tune has decided: continue, or prune (ASHA stopped the trial), upon
    which the run raises TrialPruned and records status "pruned" itself, at that evaluation."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.count = 0  # the run's asks so far; on the actor's side, the asks reported

    def ask(self, objective: Any, step: int) -> bool:
        """In the run (the main process): report, wait for the answer; True: prune."""
        if not math.isfinite(objective):
            return True  # a nan objective: nothing to learn from the rest of the trial (as with Optuna)
        number, self.count = self.count, self.count + 1
        write_json(self.folder / f"ask-{number}.json", {"objective": objective, "step": step})
        answer = self.folder / f"answer-{number}.json"
        while not answer.is_file():
            time.sleep(POLL_S)
        return bool(_read_json(answer)["prune"])

    def next_ask(self) -> dict[str, Any] | None:
        """In the actor: the run's next report, if it has made it."""
        ask = _read_json(self.folder / f"ask-{self.count}.json")
        if ask is not None:
            self.count += 1
        return ask

    def answer(self, prune: bool) -> None:
        """In the actor: Tune's decision on the last report."""
        write_json(self.folder / f"answer-{self.count - 1}.json", {"prune": prune})


def make_scheduler(space: Any, max_steps: int) -> Any:
    """ASHA on the trials' steps for any pruner but "none" (Optuna's pruners are Optuna's), its options
    from the space's pruner table; checked before the sweep starts (``Sweep._check``)."""
    import_ray()
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if space.pruner["type"] == "none":
        return FIFOScheduler()
    options = {key: value for key, value in space.pruner.items() if key != "type"}
    unknown = [key for key in options if key not in ASHA_OPTIONS]
    if unknown:
        raise ConfigError(f"pruner: {unknown[0]}: with --backend ray the pruner is Ray's ASHA scheduler, whose "
                          f"options are {', '.join(ASHA_OPTIONS)}")
    options.setdefault("max_t", max_steps if max_steps > 0 else RUN_BY_EPOCHS_MAX_T)  # the rungs' last step
    mode = "min" if space.directions[0] == "minimize" else "max"
    try:  # stop_last_trials=False: ASHA prunes, the run's own length ends it
        return ASHAScheduler(time_attr="step", metric="objective", mode=mode, stop_last_trials=False, **options)
    except (AssertionError, TypeError, ValueError) as exc:
        raise ConfigError(f"pruner: {exc or 'an option is out of range'}; see ray.tune.schedulers.ASHAScheduler") \
            from None


def _read_json(path: Path) -> Any:
    """A file written whole (write_json renames it into place), or None while it is not there."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
