"""Errors a user can act on.

Every error the engine raises for bad input derives from :class:`EngineError`. The CLI prints
its message on one line and exits with the error's ``exit_status`` (2, or 3 for a diverged
run), without a traceback, so the message must say what to change.
"""


class EngineError(Exception):
    """Bad input the user can fix; the message says what to change."""

    exit_status = 2


class ConfigError(EngineError):
    """A run file, a section or a value is wrong; the message names the key path."""


class PluginError(EngineError):
    """A plugin is unknown, fails to import, registers a duplicate name or refuses the run."""


class MissingDependencyError(EngineError):
    """A feature needs a package that is not installed; the message names it."""


class CheckpointError(EngineError):
    """A checkpoint is missing, incomplete or does not match the run."""


class UserCodeError(EngineError):
    """Code the run names (a model factory, a data function, compute_metrics, a plugin) raised.

    The message names the config key, the code and the exception; the original exception is
    its ``__cause__`` (``engine --traceback`` prints it).
    """


class TrainingDiverged(EngineError):
    """The loss, the gradient norm or the weights became non-finite (nan or inf).

    The run stops before anything non-finite is saved; the CLI exits with status 3, so scripts
    can tell a diverged run (lower the learning rate) from bad input (status 2).
    """

    exit_status = 3


class TrainingPreempted(EngineError):
    """A SIGTERM stopped the run with ``train.enable_jit_checkpoint``: the step it was in was saved.

    What preemptible clusters send before they kill a job. The CLI exits with status 143 (a
    SIGTERM's own status, so a scheduler sees the job as terminated and can requeue it); the run
    continues from that checkpoint with ``resume_from_checkpoint = true``.
    """

    exit_status = 143


class TrialPruned(EngineError):
    """A hyper-parameter search's pruner stopped this trial at an evaluation. Not bad input: run.json
    records status "pruned" and the CLI exits with status 4, so the search tells it from a failed trial."""

    exit_status = 4


class RestartTraining(Exception):
    """Raised from a training step to start training again from where it started.

    The loop resets ``run.state`` and ``run.control``, calls ``on_restart`` (each plugin puts its
    own state back), makes the train loader, optimizer and scheduler again and, when the run
    resumed, loads that checkpoint again. The builtin ``auto_find_batch_size`` raises it on an
    out-of-memory error, after choosing a smaller batch. Not an :class:`EngineError`: it never
    leaves the loop.
    """
