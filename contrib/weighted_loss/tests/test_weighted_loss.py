"""Tests for engine-weighted-loss, through the engine's public API only (no mocks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from engine_weighted_loss import WeightedLoss, weighted_cross_entropy

import engine
import engine.plugins
from engine.testing import run_steps, same_weights, tiny_dataset, tiny_model, write_run_file

VOCAB = 128
SGD = {"optim": "sgd", "learning_rate": 0.05, "lr_scheduler_type": "constant", "max_grad_norm": 0.0}


def _losses(run):
    return [entry["loss"] for entry in run.state.log_history if "loss" in entry]


def _run(sections=None, model=None, dataset=None, tmp_path=None, plugin=None):
    """A composed and set-up run (no training): its hook answers compute_loss like training does.
    ``plugin``: a WeightedLoss instance to use instead of the entry point's (to look at its weights)."""
    config = {"plugins": ["weighted_loss"], "weighted_loss": sections or {},
              "train": {"max_steps": 1, "save_strategy": "no", "disable_tqdm": True, "output_dir": str(tmp_path)}}
    run = engine.Run(config, model=model if model is not None else tiny_model(),
                     train_dataset=dataset if dataset is not None else tiny_dataset(),
                     plugins=[plugin] if plugin is not None else None)
    run.setup()
    return run


def _loss(run, batch, num_items_in_batch=None):
    with torch.no_grad():
        return run.hook.compute_loss(run=run, model=run.wrapped_model, batch=batch,
                                     num_items_in_batch=num_items_in_batch)


def _lm_batch(n=4):
    rows = torch.stack([tiny_dataset()[i]["input_ids"] for i in range(n)])
    labels = rows.clone()
    labels[0, :5] = -100  # ignored tokens count neither in the sum nor in the item count
    labels[2, 9:] = -100
    return {"input_ids": rows, "labels": labels}


def _by_hand(logits, targets, weight, smoothing, denominator):
    """sum_i [(1 - e) w[y_i] (-log p_i[y_i]) + e/C sum_c w[c] (-log p_i[c])] / denominator (torch's definition)."""
    keep = targets.ne(-100)
    logits, targets = logits[keep].float(), targets[keep]
    nll = -torch.log_softmax(logits, dim=-1)
    classes = logits.shape[-1]
    target_term = weight[targets] * nll.gather(1, targets[:, None]).squeeze(1)
    smooth_term = (nll * weight).sum(dim=-1) / classes
    return ((1 - smoothing) * target_term + smoothing * smooth_term).sum() / denominator


# ---------------------------------------------------------------------------- discovery


def test_plugin_is_installed_and_each_run_gets_its_own_instance():
    installed = engine.plugins.installed_plugins()["weighted_loss"]
    assert (installed.distribution, installed.value) == ("engine-weighted-loss", "engine_weighted_loss:WeightedLoss")
    first, second = installed.load(), installed.load()
    assert isinstance(first, WeightedLoss) and first is not second


# ---------------------------------------------------------------------------- numbers


def test_causal_lm_loss_is_weighted_smoothed_and_shifted(tmp_path):
    weights = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    run = _run({"class_weights": weights.tolist(), "label_smoothing": 0.2}, tmp_path=tmp_path)
    assert run.label_shift
    batch = _lm_batch()
    with torch.no_grad():
        logits = run.model(input_ids=batch["input_ids"]).logits
    shifted_logits, shifted_labels = logits[:, :-1], batch["labels"][:, 1:]
    items = int(shifted_labels.ne(-100).sum())
    assert items == 4 * 15 - 4 - 7

    expected = _by_hand(shifted_logits, shifted_labels, weights, 0.2, items)
    torch.testing.assert_close(_loss(run, batch), expected)
    # the same numbers from torch's own weighted, smoothed cross-entropy (sum), over the item count
    reference = F.cross_entropy(shifted_logits.reshape(-1, VOCAB), shifted_labels.reshape(-1), weight=weights,
                                label_smoothing=0.2, reduction="sum") / items
    torch.testing.assert_close(_loss(run, batch), reference)
    # with num_items_in_batch (an accumulation window): the sum over this batch / the window's count
    torch.testing.assert_close(_loss(run, batch, torch.tensor(100)), _by_hand(shifted_logits, shifted_labels,
                                                                              weights, 0.2, 100))


def test_weights_divide_by_the_item_count_not_by_the_weights_of_the_targets(tmp_path):
    weights = torch.ones(VOCAB)
    weights[::2] = 4.0
    run = _run({"class_weights": weights.tolist()}, tmp_path=tmp_path)
    batch = _lm_batch()
    with torch.no_grad():
        logits = run.model(input_ids=batch["input_ids"]).logits[:, :-1].reshape(-1, VOCAB)
    labels = batch["labels"][:, 1:].reshape(-1)
    kept = labels[labels.ne(-100)]
    torch_mean = F.cross_entropy(logits, labels, weight=weights)  # divides by sum(weights[targets])
    ours = _loss(run, batch)
    torch.testing.assert_close(ours, torch_mean * weights[kept].sum() / kept.numel())
    assert not torch.allclose(ours, torch_mean)


def test_split_batches_add_up_only_with_the_item_count():
    """Why the item count: the window's loss is the sum of its micro-batches' losses; a weighted
    mean per micro-batch (torch's reduction="mean") does not add up to the big batch's."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 3, generator=generator)
    labels = torch.tensor([0, 0, 0, 1, 2, 2, 1, -100])
    weight = torch.tensor([0.5, 3.0, 1.5])
    whole = weighted_cross_entropy(logits, labels, weight, 0.1, shift=False)
    items = labels.ne(-100).sum()
    parts = [weighted_cross_entropy(logits[s], labels[s], weight, 0.1, False, items)
             for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    means = [F.cross_entropy(logits[s], labels[s], weight=weight) for s in (slice(0, 3), slice(3, 8))]
    assert not torch.allclose((means[0] * 3 + means[1] * 4) / 7, F.cross_entropy(logits, labels, weight=weight))


def test_classifier_logits_and_labels_are_not_shifted():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, generator=generator)
    labels = torch.tensor([2, 0, 1, -100, 2])
    weight = torch.tensor([1.0, 2.0, 0.5])
    torch.testing.assert_close(weighted_cross_entropy(logits, labels, weight, 0.1, shift=False),
                               _by_hand(logits, labels, weight, 0.1, 4))


# ---------------------------------------------------------------------------- against the builtin loss


def test_all_ones_and_no_smoothing_leave_the_loss_to_the_builtin(tmp_path):
    builtin = run_steps(4, output_dir=tmp_path / "builtin", train=SGD)
    ones = run_steps(4, plugins=["weighted_loss"], output_dir=tmp_path / "ones", train=SGD,
                     sections={"weighted_loss": {"class_weights": [1.0] * VOCAB}})
    assert same_weights(builtin.model, ones.model) == []
    assert _losses(builtin) == _losses(ones)
    assert ones.plugin_manager.call_plugin("compute_loss", "weighted_loss", run=ones, model=ones.model,
                                           batch=_lm_batch(), num_items_in_batch=None) is None


def test_smoothing_with_weights_of_one_is_the_builtin_label_smoothing(tmp_path):
    """The plugin's own path (weights of all 1) against the builtin's label_smoothing_factor: equal bits."""
    train = {**SGD, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}
    dataset = tiny_dataset(ragged=True)
    builtin = run_steps(4, output_dir=tmp_path / "builtin", dataset=dataset,
                        train={**train, "label_smoothing_factor": 0.1})
    plugin = run_steps(4, plugins=["weighted_loss"], output_dir=tmp_path / "plugin", dataset=dataset, train=train,
                       sections={"weighted_loss": {"class_weights": {"3": 1.0}, "label_smoothing": 0.1}})
    assert plugin.plugin_manager.call_order("compute_loss")[0] == "weighted_loss"
    assert same_weights(builtin.model, plugin.model) == []
    assert _losses(builtin) == _losses(plugin)


def test_accumulating_two_batches_of_two_equals_one_batch_of_four(tmp_path):
    weights = [1.0 + (i % 5) for i in range(VOCAB)]
    section = {"weighted_loss": {"class_weights": weights, "label_smoothing": 0.05}}
    dataset = tiny_dataset(ragged=True)  # micro-batches with different item counts (padding)
    big = run_steps(4, plugins=["weighted_loss"], output_dir=tmp_path / "big", dataset=dataset, sections=section,
                    train={**SGD, "per_device_train_batch_size": 4})
    split = run_steps(4, plugins=["weighted_loss"], output_dir=tmp_path / "split", dataset=dataset, sections=section,
                      train={**SGD, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2})
    difference = max((a - b).abs().max().item() for a, b in zip(big.model.parameters(), split.model.parameters()))
    assert difference < 1e-6
    assert _losses(big) == pytest.approx(_losses(split), abs=1e-5)
    plain = run_steps(4, output_dir=tmp_path / "plain", dataset=dataset,
                      train={**SGD, "per_device_train_batch_size": 4})
    assert same_weights(big.model, plain.model)  # the weights did change the updates


# ---------------------------------------------------------------------------- composed runs


def test_weighted_run_trains(tmp_path):
    run = run_steps(20, plugins=["weighted_loss"], output_dir=tmp_path,
                    sections={"weighted_loss": {"class_weights": {"7": 5.0, "8": 0.2}, "label_smoothing": 0.1}})
    losses = _losses(run)
    assert run.plugin_manager.call_order("compute_loss")[0] == "weighted_loss"
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_eval_loss_is_plain_cross_entropy_when_asked(tmp_path):
    weights = [float(1 + i % 3) for i in range(VOCAB)]

    def eval_loss(plugins, section):
        run = engine.Run({"plugins": plugins, **section, "train": {"output_dir": str(tmp_path), "max_steps": 1}},
                         model=tiny_model(), train_dataset=tiny_dataset())
        return run.evaluate(tiny_dataset(size=8, seed=1))["eval_loss"]

    builtin = eval_loss([], {})
    weighted = eval_loss(["weighted_loss"], {"weighted_loss": {"class_weights": weights}})
    plain = eval_loss(["weighted_loss"], {"weighted_loss": {"class_weights": weights, "apply_to_eval": False}})
    assert plain == builtin and weighted != builtin


def test_engine_train_with_a_run_file(tmp_path):
    run_file = write_run_file(tmp_path, ["weighted_loss"], {"weighted_loss": {"class_weights": {"5": 2.0},
                                                                                "label_smoothing": 0.1}})
    result = subprocess.run([sys.executable, "-m", "engine", "train", str(run_file)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert json.loads((tmp_path / "out" / "hyperparams.json").read_text())["weighted_loss"] == {
        "class_weights": {"5": 2.0}, "label_smoothing": 0.1, "apply_to_eval": True}


def test_engine_train_refuses_weights_that_do_not_fit_the_built_model(tmp_path):
    run_file = write_run_file(tmp_path, ["weighted_loss"], {"weighted_loss": {"class_weights": [1.0, 2.0, 3.0]}})
    result = subprocess.run([sys.executable, "-m", "engine", "train", str(run_file)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("engine: error:")]
    assert line.startswith("engine: error: weighted_loss.class_weights: 3 weights, but the model has ")


# ---------------------------------------------------------------------------- a sequence classifier


class LabelledRows(torch.utils.data.Dataset):
    """Rows of 16 consecutive tokens; the label is the third of the vocabulary they start in."""

    def __init__(self, size=96, seed=0):
        self.rows = tiny_dataset(size=size, seed=seed).rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "label": int(self.rows[index, 0]) * 3 // VOCAB}


def _classifier():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def test_sequence_classifier_trains_with_class_weights(tmp_path):
    weights = [1.0, 3.0, 0.5]
    run = run_steps(30, plugins=["weighted_loss"], output_dir=tmp_path, model=_classifier(), dataset=LabelledRows(),
                    data_collator=transformers.default_data_collator,
                    sections={"weighted_loss": {"class_weights": weights, "label_smoothing": 0.05}})
    assert not run.label_shift
    losses = _losses(run)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 * 0.8
    batch = transformers.default_data_collator([LabelledRows()[i] for i in range(8)])
    run.model.eval()
    with torch.no_grad():
        logits = run.model(input_ids=batch["input_ids"]).logits
        loss = run.hook.compute_loss(run=run, model=run.model, batch=batch, num_items_in_batch=None)
    assert logits.shape == (8, 3)
    torch.testing.assert_close(loss, _by_hand(logits, batch["labels"], torch.tensor(weights), 0.05, 8))


def test_balanced_weights_come_from_the_training_labels(tmp_path):
    data = LabelledRows()
    counts = torch.bincount(torch.tensor([data[i]["label"] for i in range(len(data))]), minlength=3)
    plugin = WeightedLoss()
    _run({"class_weights": "balanced"}, model=_classifier(), dataset=data, tmp_path=tmp_path, plugin=plugin)
    assert counts.min() > 0 and counts.max() > counts.min() + 5  # unbalanced, every class present
    torch.testing.assert_close(plugin.weight, len(data) / (3 * counts.float()))
    mean_over_labels = (plugin.weight * counts).sum() / counts.sum()
    torch.testing.assert_close(mean_over_labels, torch.tensor(1.0))


def test_balanced_weights_refuse_a_streaming_dataset(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(LabelledRows())

    with pytest.raises(engine.ConfigError, match=r"^weighted_loss\.class_weights = 'balanced' counts the training "
                                                 r"labels, which a dataset without a length \(streaming\) cannot"):
        engine.Run({"plugins": ["weighted_loss"], "weighted_loss": {"class_weights": "balanced"},
                    "train": {"max_steps": 1, "output_dir": str(tmp_path)}}, train_dataset=Stream())


# ---------------------------------------------------------------------------- bad options


@pytest.mark.parametrize("section, train, message", [
    ({"class_weights": [1.0, 2.0]}, {},
     r"weighted_loss\.class_weights: 2 weights, but the model has 128 classes \(logits of size 128\)"),
    ({"class_weights": [1.0] * 127 + [-0.5]}, {}, r"weighted_loss\.class_weights\[127\]: expected a finite float >= 0"),
    ({"class_weights": {"4": -1.0}}, {}, r"weighted_loss\.class_weights\[4\]: expected a finite float >= 0"),
    ({"class_weights": {"cat": 2.0}}, {}, r"weighted_loss\.class_weights: table keys are class ids"),
    ({"class_weights": {"128": 2.0}}, {}, r"weighted_loss\.class_weights: class id 128, but the model has 128 classes"),
    ({"class_weights": {"3": "heavy"}}, {}, r"weighted_loss\.class_weights\[3\]: expected float, got str 'heavy'"),
    ({"class_weights": [0.0] * 128}, {}, r"weighted_loss\.class_weights: every weight is 0"),
    ({"class_weights": []}, {}, r"weighted_loss\.class_weights: expected one weight per class, got an empty list"),
    ({"class_weights": "heavy"}, {}, r"weighted_loss\.class_weights: expected list of float \| table \| 'balanced'"),
    ({"label_smoothing": 1.0}, {}, r"weighted_loss\.label_smoothing: expected float in \[0, 1\), got 1\.0"),
    ({"label_smoothing": -0.1}, {}, r"weighted_loss\.label_smoothing: expected float in \[0, 1\), got -0\.1"),
    ({"smoothing": 0.1}, {}, r"weighted_loss\.smoothing: unknown key; did you mean 'label_smoothing'\?"),
    ({}, {"label_smoothing_factor": 0.1}, r"train\.label_smoothing_factor: the weighted_loss plugin computes the "
                                          r"loss; set weighted_loss\.label_smoothing = 0\.1 instead"),
])
def test_bad_options_are_refused_in_one_line_naming_the_key(section, train, message, tmp_path):
    with pytest.raises(engine.ConfigError, match=f"^{message}") as err:
        engine.Run({"plugins": ["weighted_loss"], "weighted_loss": section,
                    "train": {"output_dir": str(tmp_path), **train}}, model=tiny_model())
    assert "\n" not in str(err.value)
