"""The hooks only the tooling asks, declared beside it: they join ``engine.hookspecs`` through the
entry-point group ``engine.hookspecs`` (``tooling = "engine.tooling.hookspecs"``), as the builtins' do."""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("engine")


# ------------------------------------------------------------ engine.tooling.accelerate_config


@hookspec
def accelerate_mappings() -> dict[str, Any] | None:
    """Map keys of an Accelerate config file onto this plugin, for ``--accelerate-config``.

    **When**: while ``--accelerate-config`` is read, on the installed plugin that the catalogue of
    first-party plugins names for such a key (``fsdp_config``: fsdp), whether or not the run enables
    it yet. **Combine**: broadcast, asked of that one plugin: ``{Accelerate key: handler(mapping,
    key, value, enabled)}``, where ``enabled`` is the strategy plugin the file's
    ``distributed_type`` enables; ``engine.kit.mappings.nested`` makes the handler of a table of
    settings.

    Example::

        @hookimpl
        def accelerate_mappings():
            return {"fsdp_config": nested("fsdp", "FSDP", "an FSDP setting", FSDP_CONFIG)}
    """


# ------------------------------------------------------------ engine.tooling.search


@hookspec(firstresult=True)
def hyperparameter_search(run: Any, hp_space: Any, compute_objective: Any, n_trials: int, direction: Any,
                          backend: str | None, hp_name: Any, kwargs: dict[str, Any]) -> Any:
    """``Run.hyperparameter_search``: Trainer's search over runs made like ``run``.

    **When**: by :meth:`engine.Run.hyperparameter_search`, on the plugins of the entry-point group
    ``engine.commands``. **Combine**: firstresult: what the search returns (Trainer's ``BestRun``, or a
    list of them for several directions). The arguments are Trainer's; ``kwargs`` go to the backend
    (``optuna.create_study`` / ``study.optimize``, ``ray.tune.Tuner``). The engine's tooling answers it
    (engine/tooling/search.py) with the backends ``optuna`` and ``ray``.

    Example::

        @hookimpl
        def hyperparameter_search(run, hp_space, compute_objective, n_trials, direction, backend, hp_name,
                                  kwargs):
            if backend == "grid":
                return my_grid_search(run, hp_space, n_trials)
    """
