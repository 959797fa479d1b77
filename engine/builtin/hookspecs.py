"""The hooks the builtins call: their extension points, declared beside them as any plugin may declare its own.

A module of hook specs joins the engine's through the entry-point group ``engine.hookspecs`` (engine's
own: ``builtin = "engine.builtin.hookspecs"``), so every hook is ``engine.hookspecs.<name>``, is
checked, listed and shown by ``engine plan`` like the kernel's, and the hook reference (docs/hooks.md)
lists it. The kernel never calls these: a builtin does (named in each section), so a run that blocks
that builtin and enables no plugin in its place never asks them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # only for annotations: importing the specs must stay cheap
    import torch

    from engine.state import RunView

hookspec = pluggy.HookspecMarker("engine")


# ------------------------------------------------------------ builtin.loaders, builtin.evaluation: examples


@hookspec
def keep_columns(run: RunView) -> list[str] | None:
    """Name example columns your collator or loss reads that the model's forward does not take.

    **When**: where the train and evaluation loaders' examples are made (``engine.kit.loaders``):
    ``train.remove_unused_columns`` (as Trainer) drops the columns that are no argument of the
    model's forward, except these. **Combine**: broadcast; the lists are joined.

    Example::

        @hookimpl
        def keep_columns(run):
            return ["prompt_ids", "chosen_ids", "rejected_ids"]
    """


# ------------------------------------------------------------ builtin.models: building train.model


@hookspec
def model_load_kwargs(run: RunView) -> dict[str, Any] | None:
    """Keywords for ``from_pretrained`` when ``train.model`` is a saved model folder.

    **When**: when the model builtin builds ``train.model`` in :func:`create_model` (after
    :func:`configure`; the keywords go to ``from_pretrained`` where it loads a folder).
    **Combine**: broadcast; the dicts are merged, and one key from two plugins is refused naming
    both. The peft plugin answers QLoRA's ``quantization_config``, so the base
    loads quantized, never at full size first.

    Example::

        @hookimpl
        def model_load_kwargs(run):
            return {"attn_implementation": "sdpa"}
    """


# --------------------------------------------------- builtin.evaluation: evaluation and prediction


@hookspec(firstresult=True)
def prediction_step(run: RunView, model: torch.nn.Module, batch: dict[str, Any], num_items_in_batch: Any,
                    prediction_loss_only: bool) -> tuple[torch.Tensor, Any, Any] | None:
    """One evaluation or prediction batch: ``(loss, predictions, labels)``, as Trainer.prediction_step.

    **When**: for every batch of :func:`evaluate` and :func:`predict`, on every process, under
    ``torch.no_grad``; ``model`` is the strategy's (wrapped) model and ``batch`` is on its device.
    With ``prediction_loss_only`` only the loss is used (return None for the other two).
    ``loss`` is :func:`compute_loss`'s for the batch (divided by ``num_items_in_batch``, as
    there); ``predictions`` (a tensor or a tuple of tensors, one row per example) are what
    ``compute_metrics`` and :meth:`Run.predict` get; ``labels`` the batch's ``train.label_names``
    (None without them). Run the forward under ``run.strategy.autocast()``. **Combine**:
    firstresult. The builtin answers with the logits of the forward :func:`compute_loss` runs
    (through ``preprocess_logits_for_metrics``); with ``train.predict_with_generate`` the
    generation builtin answers first with ``generate()``'s token ids.

    Example (predictions as class ids: the metrics see less data)::

        @hookimpl(tryfirst=True)
        def prediction_step(run, model, batch, num_items_in_batch, prediction_loss_only):
            with run.strategy.autocast():
                outputs = model(**batch)  # its loss: the mean over this batch's label tokens
            return outputs.loss, outputs.logits.argmax(-1), batch["labels"]
    """


@hookspec
def on_prediction_step(run: RunView, step: int, total: int | None) -> None:
    """One batch of an evaluation or prediction pass is done.

    **When**: after each eval/predict batch's forward, on every process; ``step`` counts this
    pass's batches from 1, ``total`` is its number of batches (None for an iterable dataset).
    **Combine**: broadcast. The console draws its evaluation bar from it.

    Example::

        @hookimpl
        def on_prediction_step(run, step, total):
            if step == total:
                print(f"evaluated {total} batches")
    """


@hookspec
def on_predict(run: RunView, metrics: dict[str, float]) -> None:
    """A prediction pass (:meth:`Run.predict`) finished with ``metrics`` (keys prefixed ``test_``).

    **When**: at the end of every :meth:`Run.predict`, on every process. As under Trainer, the
    metrics are returned, not logged (no :func:`log_metrics`), and predictions are not evaluations:
    :func:`on_evaluate` does not fire for them (early stopping must not count them).
    **Combine**: broadcast.

    Example::

        @hookimpl
        def on_predict(run, metrics):
            print(f"predicted: {metrics}")
    """


# ---------------------------------------------------- builtin.resume: the checkpoint a run resumes


@hookspec(firstresult=True)
def locate_checkpoint(run: RunView, spec: str) -> str | None:
    """Turn ``train.resume_from_checkpoint = spec`` (a string) into a local checkpoint folder.

    **When**: once, while the main process claims ``output_dir`` (before anything loads), when
    ``resume_from_checkpoint`` is a string. **Combine**: firstresult: the first plugin that
    knows ``spec`` (a name such as ``"hub"``, a URL) fetches the checkpoint and returns the
    local folder; None from all means ``spec`` is a local path. The folder returned is validated
    like any other (files, plugins, data order, every checksum of its manifest) before it is
    resumed. Raise :class:`engine.errors.ConfigError` when ``spec`` is yours but holds no checkpoint.

    Example::

        @hookimpl
        def locate_checkpoint(run, spec):
            if spec.startswith("s3://"):
                local = run.output_dir / ".tmp-download"
                download(spec, local)
                return str(local)
    """


# -------------------------------------------------- builtin.trainer_args: TrainingArguments fields


@hookspec
def trainer_argument_mappings() -> dict[str, Any] | None:
    """Answer ``transformers.TrainingArguments`` fields that this plugin provides, for ``engine migrate``.

    **When**: when ``engine migrate`` converts such a field (and when a run's ``[train]`` names it,
    to say where it goes), on the installed plugin that the catalogue of first-party plugins
    names for it, whether or not a run enables it. **Combine**: broadcast, asked of that one
    plugin: ``{field name: engine.kit.mappings.Answer}``; the answer's converter writes the
    plugin's own keys (see :mod:`engine.kit.mappings`), so the engine's table names none of them.

    Example::

        @hookimpl
        def trainer_argument_mappings():
            return {"deepspeed": plugin("deepspeed", "config", convert=convert_deepspeed)}
    """
