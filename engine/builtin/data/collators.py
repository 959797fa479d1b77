"""The batch collators: :class:`DataCollator`, and :class:`FlatteningCollator` for document packing and
padding-free batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from engine.errors import ConfigError
from engine.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from engine.config import DataConfig  # assembled from the builtins' options: not at import
    from transformers import PreTrainedTokenizerBase


LABEL_KEYS = ("labels", "label", "label_ids")  # where the collators find an example's labels, in this order


class DataCollator:
    """Batches examples: stacks equal-length rows, else right-pads and adds ``attention_mask``.

    Padded ``input_ids`` get ``pad_token_id``, padded ``labels`` get -100 (ignored by the loss).
    Examples without ``labels`` learn every real token. A scalar label per example (a class id,
    or a float for regression; ``label`` or ``label_ids`` as transformers' collators also take
    it) is stacked into ``labels [batch]``; label rows of another length than their
    ``input_ids`` (seq2seq targets) are padded to the longest of them. Other keys are kept when
    they stack.
    """

    _CORE_KEYS = ("input_ids", "labels", "attention_mask")
    _LABEL_KEYS = LABEL_KEYS

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        key = next((k for k in self._LABEL_KEYS if k in features[0]), None)
        if key is not None and key != "labels":
            features = [{("labels" if k == key else k): v for k, v in f.items()} for f in features]
        if key is not None and torch.as_tensor(features[0]["labels"]).dim() == 0:
            values = [f["labels"] for f in features]
            scalar = torch.as_tensor(values, dtype=torch.float32 if any(isinstance(v, float) or (
                isinstance(v, torch.Tensor) and v.is_floating_point()) for v in values) else torch.long)
            batch = self([{k: v for k, v in f.items() if k != "labels"} for f in features])
            batch["labels"] = scalar
            return batch
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        labels = [torch.as_tensor(f["labels"], dtype=torch.long) if "labels" in f else None
                  for f in features]
        masks = [torch.as_tensor(f["attention_mask"], dtype=torch.long) if "attention_mask" in f
                 else None for f in features]
        targets = any(lab is not None and len(lab) != len(row) for row, lab in zip(ids, labels))
        if len({len(row) for row in ids}) == 1 and all(m is None for m in masks) and not targets:
            # Packed data: nothing to pad, and no mask means the model attends to everything.
            batch = {"input_ids": torch.stack(ids),
                     "labels": torch.stack([row if lab is None else lab for row, lab in zip(ids, labels)])}
        else:
            batch = self._pad(ids, labels, masks)
            if targets:  # seq2seq: the model makes its decoder inputs from the labels
                batch["labels"] = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True,
                                                                  padding_value=IGNORE_INDEX)
        for key in features[0]:
            if key in self._CORE_KEYS:
                continue
            try:
                batch[key] = torch.stack([torch.as_tensor(f[key]) for f in features])
            except (KeyError, TypeError, ValueError, RuntimeError):
                pass  # metadata such as string ids or ragged lists is no model input
        return batch

    def _pad(self, ids: list[torch.Tensor], labels: list[torch.Tensor | None],
             masks: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        size = (len(ids), max(len(row) for row in ids))
        input_ids = torch.full(size, self.pad_token_id, dtype=torch.long)
        label_ids = torch.full(size, IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros(size, dtype=torch.long)
        for i, (row, lab, mask) in enumerate(zip(ids, labels, masks)):
            n = len(row)
            input_ids[i, :n] = row
            attention[i, :n] = 1 if mask is None else mask
            if lab is None:
                label_ids[i, :n] = row.masked_fill(attention[i, :n] == 0, IGNORE_INDEX)
            else:
                label_ids[i, : len(lab)] = lab
        return {"input_ids": input_ids, "labels": label_ids, "attention_mask": attention}


class FlatteningCollator:
    """Padding-free batches (as transformers' DataCollatorWithFlattening and TRL's padding_free):
    the rows concatenated into one ``[1, tokens]`` row with ``position_ids`` restarting per
    document (a document-packed row's own, else each row is one document); the label of each
    document's first token is -100, so no document learns from the one before it. The model's
    attention separates documents by their position_ids."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.cat([torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features])
        positions = torch.cat([torch.as_tensor(f["position_ids"], dtype=torch.long) if "position_ids" in f
                               else torch.arange(len(f["input_ids"])) for f in features])
        labels = torch.cat([torch.as_tensor(f.get("labels", f["input_ids"]), dtype=torch.long) for f in features])
        labels = labels.masked_fill(positions == 0, IGNORE_INDEX)
        return {"input_ids": ids[None], "labels": labels[None], "position_ids": positions[None]}


# Attention implementations that keep the documents of a position_ids-packed row apart: flash
# attention takes them as sequence boundaries, transformers' masking_utils builds a block-diagonal
# causal mask from them for the others.
DOCUMENT_PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def flattens(data: DataConfig) -> str | None:
    """The setting that makes batches padding-free (document packing, ``data.padding_free``), or None."""
    if data.packing in ("document", "bfd", "bfd_split"):
        return f"data.packing = \"{data.packing}\""
    return "data.padding_free = true" if data.padding_free else None


def enable_document_packing(model: torch.nn.Module, setting: str = "data.packing = \"document\"") -> None:
    """Refuse padding-free batches (``setting``, see :func:`flattens`) for a model whose attention would
    mix the documents; else turn its KV cache off (transformers reads packed documents from
    position_ids only without a cache)."""
    import inspect

    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    if not takes_positions or implementation not in DOCUMENT_PACKING_ATTENTION:
        raise ConfigError(
            f"{setting}: the model ({type(model).__name__}, attention "
            f"{implementation or 'unknown'}) cannot keep packed documents apart: that needs a transformers model "
            f"taking position_ids with attention {' / '.join(DOCUMENT_PACKING_ATTENTION)}; "
            "set data.packing = true or false"
            + (" and data.padding_free = false" if "padding_free" in setting else ""))
    config.use_cache = False


def collator_for(data: DataConfig, tokenizer: PreTrainedTokenizerBase | None) -> Callable[[list[Any]], Any]:
    if flattens(data):
        return FlatteningCollator()
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return DataCollator(pad_id if pad_id is not None else 0)
