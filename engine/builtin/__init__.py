"""The builtin plugins: the defaults, written with the same hooks third parties use.

They are registered in every run (as ``builtin.<module>``) unless the run blocks one
(``plugins = ["-builtin.console"]``, ``--plugins -builtin.console``), are called after every
enabled plugin, and their registered names are replaced by an enabled plugin that registers the
same name. They pass the checks every plugin passes, and the engine knows them by where they were
registered from, never by their names.
"""

# The builtins, in call order among themselves: "module" registers the module, "module:Class" a
# fresh instance per run. The kernel finds this list through the entry point "engine.builtins"
# (pyproject.toml), as it finds any plugin, and names no builtin itself.
PLUGINS = (
    "engine.builtin.arguments",
    "engine.builtin.trainer_args",
    "engine.builtin.data",
    "engine.builtin.loaders",
    "engine.builtin.models:Models",
    "engine.builtin.tasks:Tasks",
    "engine.builtin.loss",
    "engine.builtin.optimizers",
    "engine.builtin.schedulers",
    "engine.builtin.strategies",
    "engine.builtin.steps",
    "engine.builtin.patches",
    "engine.builtin.weights",
    "engine.builtin.evaluation",
    "engine.builtin.generation:PredictWithGenerate",
    "engine.builtin.resume",
    "engine.builtin.flow:Flow",
    "engine.builtin.best_model:BestModel",
    "engine.builtin.sigterm:Sigterm",
    "engine.builtin.memory:Memory",
    "engine.builtin.autobatch:AutoBatch",
    "engine.builtin.console:Console",
    "engine.builtin.jsonl:JsonlLogger",
    "engine.builtin.report:Report",
)
