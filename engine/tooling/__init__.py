"""The engine's tooling: commands around runs, which no run needs and the kernel never imports.

* :mod:`engine.tooling.commands`: the plugin (entry-point group ``engine.commands``) that adds
  ``engine migrate``, ``engine report``, ``engine plugins new`` / ``--check`` and
  ``--accelerate-config`` to the command line.
* :mod:`engine.tooling.migration`: ``engine migrate`` (``engine.migrate(training_args)``), a run
  file from ``transformers.TrainingArguments`` through the table of the builtin ``trainer_args``.
* :mod:`engine.tooling.accelerate_config`: an Accelerate config file mapped onto the run.
* :mod:`engine.tooling.authoring`: ``engine plugins --check`` and ``engine plugins new`` (the
  templates in ``scaffold/``).

The report that ``engine report`` writes is the builtin report plugin's
(:mod:`engine.builtin.report_writer`).
"""
