"""Kits: the public helpers for plugin authors, versioned with the engine.

A plugin imports top-level ``engine`` names and these modules, nothing else of the engine
(tests/test_public_api.py holds plugins/ and contrib/ to it). The kernel never imports a kit.

* :mod:`engine.kit.distributed`: what a strategy plugin subclasses and asks: ``Strategy``,
  ``DistributedStrategy``, ``strategy_name``, the launcher's ranks (``env_rank``,
  ``is_main_process``).
* :mod:`engine.kit.checkpoint`: checkpoint and model files for a strategy's checkpoint I/O or a
  checkpoint target (hub, mlflow): the weights a checkpoint holds (``ModelWeights``), writing,
  reading and checking weights and model folders, restoring state files, the finite-weights
  check, the final model's files, the marker and weights file names.
* :mod:`engine.kit.layout`: the names of a run folder's files (``MARKER``, ``FINAL_MARKER``, ``TMP``, ...)
  without importing torch, for a process that only moves files.
* :mod:`engine.kit.models`: the transformers config ``train.model`` names (``model_config``)
  and the positions a config declares (``max_positions``), before the model is built.
* :mod:`engine.kit.lowrank`: low-rank projection optimizers (GaLore, APOLLO): target groups,
  layerwise stepping, projector checkpoints and their configure-time checks.
* :mod:`engine.kit.loaders`: what a DataLoader takes of a run (``loader_data``: the columns the model's
  forward takes; ``loader_options``: the ``[train] dataloader_*`` arguments; ``example_lengths``).
* :mod:`engine.kit.preference`: what preference-tuning plugins (dpo, ...) share: pair batches, completion
  log-probabilities, the reference model, metrics averaged between log rows.
* :mod:`engine.kit.mappings`: what a plugin contributes to ``engine migrate`` (its
  ``TrainingArguments`` fields) and to ``--accelerate-config`` (its Accelerate keys).

The other kits are top-level modules: :mod:`engine.optim` (optimizer families),
:mod:`engine.tracking` (trackers), :mod:`engine.loss`, :mod:`engine.metrics` and
:mod:`engine.testing` (fixtures and comparisons for a plugin's tests).
"""
