"""``builtin.weights``: checkpoints and the final model hold every weight of the model.

The default answer to ``checkpoint_weights`` (:class:`engine.ModelWeights`: ``save_pretrained``'s
layout, or ``model.safetensors`` for a plain module). A plugin that trains a part of a frozen model
answers first with its own (peft: the adapter).
"""

from engine import ModelWeights, hookimpl


@hookimpl(trylast=True)
def checkpoint_weights(run):
    return ModelWeights()
