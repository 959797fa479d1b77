"""Evaluation and prediction through hooks: evaluate, predict and prediction_step (engine/builtin/evaluation.py)."""

import numpy
import pytest
import torch

from engine import EvalPrediction, Run, hookimpl
from engine.builtin.data.collators import DataCollator
from engine.testing import run_steps, tiny_dataset, tiny_model


def _run(tmp_path, plugins=(), **keywords):
    return Run({"train": {"output_dir": str(tmp_path), "per_device_eval_batch_size": 3}}, model=tiny_model(),
               train_dataset=tiny_dataset(8), eval_dataset=tiny_dataset(7), data_collator=DataCollator(0),
               plugins=list(plugins), **keywords)


def test_a_prediction_step_plugin_changes_what_compute_metrics_gets(tmp_path):
    seen = []

    class ClassIds:
        @hookimpl(tryfirst=True)
        def prediction_step(self, run, model, batch, num_items_in_batch, prediction_loss_only):
            with run.strategy.autocast():
                outputs = model(**batch)
            return outputs.loss, outputs.logits.argmax(-1), batch["labels"]

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"rows": len(prediction.predictions)}

    plain = _run(tmp_path / "plain", compute_metrics=compute_metrics).evaluate()
    ids = _run(tmp_path / "ids", [ClassIds()], compute_metrics=compute_metrics).evaluate()
    logits, class_ids = seen
    assert isinstance(class_ids, EvalPrediction)
    assert logits.predictions.shape == (7, 16, 128) and class_ids.predictions.shape == (7, 16)
    assert class_ids.predictions.dtype == numpy.int64
    numpy.testing.assert_array_equal(class_ids.predictions, logits.predictions.argmax(-1))
    numpy.testing.assert_array_equal(class_ids.label_ids, logits.label_ids)
    assert ids["eval_rows"] == plain["eval_rows"] == 7
    assert ids["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)


def test_prediction_loss_only_asks_prediction_step_for_the_loss_alone(tmp_path):
    asked = []

    class Recorder:
        @hookimpl
        def prediction_step(self, run, prediction_loss_only):
            asked.append(prediction_loss_only)

    _run(tmp_path / "metrics", [Recorder()], compute_metrics=lambda p: {}).evaluate()
    _run(tmp_path / "loss", [Recorder()]).evaluate()  # no compute_metrics: predictions are not needed
    assert asked == [False] * 3 + [True] * 3  # 7 rows, 3 a batch


def test_a_plugin_answering_evaluate_replaces_the_builtin(tmp_path):
    calls = []

    class Remote:
        @hookimpl(tryfirst=True)
        def evaluate(self, run, dataset, prefix, report, in_training):
            calls.append((prefix, report, in_training))
            return {f"{prefix}_score": 0.5}

    run = run_steps(2, objects=[Remote()], output_dir=tmp_path, eval_dataset=tiny_dataset(4),
                    train={"eval_strategy": "steps", "eval_steps": 2})
    assert run.evaluate(metric_key_prefix="dev") == {"dev_score": 0.5}
    assert calls == [("eval", True, True), ("dev", True, False)]
    assert not any("eval_loss" in entry for entry in run.state.log_history)  # the builtin never ran


def test_predict_is_a_hook_wrappers_see_its_output(tmp_path):
    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def predict(self, run, dataset, prefix):
            output = yield
            seen.append((prefix, output.predictions.shape, sorted(output.metrics)))
            return output

    output = _run(tmp_path, [Wrapper()]).predict(tiny_dataset(5), metric_key_prefix="test")
    assert seen == [("test", (5, 16, 128), sorted(output.metrics))]
    assert "test_loss" in output.metrics and output.label_ids.shape == (5, 16)


def test_full_eval_casts_outside_training_only(tmp_path):
    run = run_steps(1, output_dir=tmp_path, eval_dataset=tiny_dataset(4),
                    train={"bf16_full_eval": True, "eval_strategy": "steps", "eval_steps": 1})
    assert run.model.dtype == torch.float32  # the evaluation during training left it as it trains
    run.evaluate()
    assert run.model.dtype == torch.bfloat16
