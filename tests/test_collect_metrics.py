"""The collect_metrics hook adds a plugin's figures to the training log rows and (prefixed) to the evaluation's;
keep_columns keeps example columns the model's forward does not take, for the plugin that reads them."""

import json

import datasets
import pytest

from engine import PluginError, hookimpl
from engine.testing import run_steps, tiny_dataset


class CountBatches:
    """Counts the batches compute_loss saw since the last row; reads each example's 'source' column."""

    name = "count-batches"

    def __init__(self, key="batches"):
        self.key, self.seen, self.sources = key, {True: 0, False: 0}, set()

    @hookimpl
    def keep_columns(self, run):
        return ["source"]

    @hookimpl(hookwrapper=True)
    def compute_loss(self, run, model, batch, num_items_in_batch):
        self.seen[model.training] += 1
        self.sources.update(batch.pop("source", []))
        yield

    @hookimpl
    def collect_metrics(self, run, prefix):
        training = not prefix
        count, self.seen[training] = self.seen[training], 0
        return {self.key: float(count)}


def rows():
    examples = tiny_dataset(16)
    return datasets.Dataset.from_list([{"input_ids": examples[i]["input_ids"].tolist(),
                                        "labels": examples[i]["labels"].tolist(), "source": f"row-{i}"}
                                       for i in range(16)])


def collate(examples):
    import torch

    batch = {key: torch.tensor([e[key] for e in examples]) for key in ("input_ids", "labels")}
    return {**batch, "source": [e["source"] for e in examples]} if "source" in examples[0] else batch


def test_figures_join_the_training_and_evaluation_rows_and_the_kept_column_reaches_the_loss(tmp_path):
    plugin = CountBatches()
    run = run_steps(4, objects=[plugin], output_dir=tmp_path, dataset=rows(), eval_dataset=rows(),
                    data_collator=collate, train={"logging_steps": 2, "eval_strategy": "steps", "eval_steps": 4,
                                                  "per_device_eval_batch_size": 8})
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["batches"] for row in logged if "loss" in row] == [2.0, 2.0]  # two steps per row
    assert [row["eval_batches"] for row in logged if "eval_loss" in row] == [2.0]  # 16 rows in batches of 8
    assert plugin.sources == {f"row-{i}" for i in range(16)}  # kept by remove_unused_columns
    assert run.state.global_step == 4


def test_one_key_from_two_plugins_is_refused(tmp_path):
    other = CountBatches()
    other.name = "count-batches-again"
    with pytest.raises(PluginError, match="two plugins log one key"):
        run_steps(2, objects=[CountBatches(), other], output_dir=tmp_path, dataset=rows(), data_collator=collate)
