"""Trainer's constructor arguments on Run, and the TrainingArguments names the engine implements."""

from __future__ import annotations

import numpy
import pytest
import torch
import transformers

from engine import Run
from engine.data import DataCollator
from engine.errors import ConfigError
from engine.testing import assert_same_state, run_steps, same_weights, tiny_dataset, tiny_model


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def test_given_optimizers_resume_bit_exact_and_another_class_is_refused(tmp_path):
    train = {"save_strategy": "steps", "save_steps": 3}
    model = tiny_model(seed=0)
    straight = run_steps(6, model=model, optimizers=_sgd(model), output_dir=tmp_path / "straight", train=train)
    assert isinstance(straight.optimizer, torch.optim.SGD)
    assert straight.state.log_history[1]["learning_rate"] == pytest.approx(0.05 / 2)  # the given scheduler ran
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    model = tiny_model(seed=1)
    resumed = run_steps(6, model=model, optimizers=_sgd(model), output_dir=tmp_path / "resumed",
                        train={**train, "resume_from_checkpoint": str(checkpoint)})
    assert same_weights(resumed.model, straight.model) == []
    assert_same_state(resumed.optimizer.state_dict(), straight.optimizer.state_dict())

    class OtherSGD(torch.optim.SGD):  # its state would load: the recorded class refuses it
        pass

    model = tiny_model(seed=1)
    other = OtherSGD(model.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(ConfigError, match="trained with a torch.optim.sgd.SGD optimizer; this run is given a "
                                          ".*OtherSGD: pass the same optimizer class"):
        run_steps(6, model=model, optimizers=(other, None), output_dir=tmp_path / "other",
                  train={**train, "resume_from_checkpoint": str(checkpoint)})
    with pytest.raises(ConfigError, match="train.optim = 'adamw_torch' makes a AdamW, but Run\\(\\) was given a SGD"):
        run_steps(1, model=model, optimizers=_sgd(model), train={"optim": "adamw_torch"})


def test_optimizer_cls_and_kwargs_builds_trainers_optimizer(tmp_path):
    cls_and_kwargs = (torch.optim.Adagrad, {"lr": 0.02, "lr_decay": 0.1})
    run = Run({"train": {"weight_decay": 0.1, "max_steps": 1, "output_dir": str(tmp_path / "engine")}},
              model=tiny_model(), train_dataset=tiny_dataset(), optimizer_cls_and_kwargs=cls_and_kwargs)
    run.setup()
    trainer = transformers.Trainer(
        model=tiny_model(), optimizer_cls_and_kwargs=cls_and_kwargs,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), weight_decay=0.1, use_cpu=True,
                                            report_to="none"))
    theirs = trainer.create_optimizer()
    assert type(run.optimizer) is type(theirs)
    groups = [[{k: v for k, v in group.items() if k not in ("params", "initial_lr")} | {"size": len(group["params"])}
               for group in optimizer.param_groups] for optimizer in (run.optimizer, theirs)]
    assert groups[0] == groups[1]


def test_model_init_processing_class_and_compute_loss_func(tmp_path):
    by_model = run_steps(3, model=tiny_model(), output_dir=tmp_path / "model")
    calls = []

    def model_init():
        calls.append(1)
        return tiny_model()

    run = Run({"train": {"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
                         "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True,
                         "output_dir": str(tmp_path / "init")}},
              model_init=model_init, train_dataset=tiny_dataset(), data_collator=DataCollator(0))
    run.train()
    assert calls == [1]
    assert same_weights(run.model, by_model.model) == []
    with pytest.raises(ConfigError, match="pass model or model_init, not both"):
        Run(model=tiny_model(), model_init=model_init)

    tokenizer = object()
    assert Run(processing_class=tokenizer).tokenizer is tokenizer
    with pytest.raises(ConfigError, match="tokenizer and processing_class are the same argument"):
        Run(tokenizer=object(), processing_class=tokenizer)

    seen = []

    def causal_loss(outputs, labels, num_items_in_batch):  # the default loss, written as Trainer users write it
        seen.append(int(num_items_in_batch))
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1]).float()
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum") / num_items_in_batch

    custom = run_steps(3, model=tiny_model(), output_dir=tmp_path / "loss", compute_loss_func=causal_loss)
    assert seen == [4 * 15] * 3  # 4 rows of 16 tokens, 15 predicted each
    assert max((a - b).abs().max().item() for a, b in zip(custom.model.parameters(), by_model.model.parameters())) < 1e-6


def _accuracy(prediction):
    predictions, labels = prediction
    predicted, target = predictions[:, :-1], labels[:, 1:]
    return {"accuracy": float(numpy.mean(predicted == target))}


def test_preprocess_logits_for_metrics_as_trainer(tmp_path):
    def argmax(logits, labels):
        return logits.argmax(-1)

    data = tiny_dataset(12, seed=3)
    trainer = transformers.Trainer(
        model=tiny_model(), eval_dataset=data, data_collator=DataCollator(0), compute_metrics=_accuracy,
        preprocess_logits_for_metrics=argmax,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=4,
                                            use_cpu=True, report_to="none", remove_unused_columns=False))
    theirs = trainer.evaluate()
    run = Run({"train": {"per_device_eval_batch_size": 4, "output_dir": str(tmp_path / "engine")}},
              model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=data, data_collator=DataCollator(0),
              compute_metrics=_accuracy, preprocess_logits_for_metrics=argmax)
    ours = run.evaluate()
    assert ours["eval_accuracy"] == theirs["eval_accuracy"]
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-5)
