"""Trainer's constructor arguments on Run, and the TrainingArguments names the engine implements."""

from __future__ import annotations

import numpy
import pytest
import torch
import transformers

from engine import Run
from engine.builtin.data.collators import DataCollator
from engine.kit.loaders import forward_columns, without_unused_columns
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


def test_preprocess_logits_for_metrics_and_include_for_metrics_as_trainer(tmp_path):
    def argmax(logits, labels):
        return logits.argmax(-1)

    def metrics(prediction):  # include_for_metrics: inputs and losses too
        inputs, losses = prediction.inputs, prediction.losses
        assert len(tuple(prediction)) == 4 and prediction[2] is inputs and prediction[3] is losses
        return {**_accuracy((prediction[0], prediction[1])), "rows": len(inputs), "first_tokens": int(inputs[:, 0].sum()),
                "losses": len(losses), "loss_mean": float(losses.mean()), "first_loss": float(losses[0])}

    data = tiny_dataset(10, seed=3)  # batches of 4, 4 and 2
    include = ["inputs", "loss"]
    trainer = transformers.Trainer(
        model=tiny_model(), eval_dataset=data, data_collator=DataCollator(0), compute_metrics=metrics,
        preprocess_logits_for_metrics=argmax,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=4,
                                            use_cpu=True, report_to="none", remove_unused_columns=False,
                                            include_for_metrics=include))
    theirs = trainer.evaluate()
    run = Run({"train": {"per_device_eval_batch_size": 4, "output_dir": str(tmp_path / "engine"),
                         "include_for_metrics": include}},
              model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=data, data_collator=DataCollator(0),
              compute_metrics=metrics, preprocess_logits_for_metrics=argmax)
    ours = run.evaluate()
    for key in ("eval_accuracy", "eval_rows", "eval_first_tokens", "eval_losses"):
        assert ours[key] == theirs[key], key
    for key in ("eval_loss", "eval_loss_mean", "eval_first_loss"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert ours["eval_rows"] == ours["eval_losses"] == 10

    def batch_metrics(prediction, compute_result):  # batch_eval_metrics: tensors, batch by batch
        predicted, target = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
        calls.append((type(predicted).__name__, len(prediction.losses), compute_result))
        totals["hits"] += int((predicted == target).sum())
        totals["count"] += target.numel()
        if not compute_result:
            return {}
        result = {"accuracy": totals["hits"] / totals["count"]}
        totals.update(hits=0, count=0)
        return result

    answers = []
    for name in ("trainer", "engine"):
        calls, totals = [], {"hits": 0, "count": 0}
        options = {"per_device_eval_batch_size": 4, "batch_eval_metrics": True, "include_for_metrics": ["loss"]}
        if name == "trainer":
            answers.append(transformers.Trainer(
                model=tiny_model(), eval_dataset=data, data_collator=DataCollator(0), compute_metrics=batch_metrics,
                preprocess_logits_for_metrics=argmax,
                args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True,
                                                    report_to="none", remove_unused_columns=False, **options)).evaluate())
        else:
            answers.append(Run({"train": {"output_dir": str(tmp_path / "engine"), **options}}, model=tiny_model(),
                               train_dataset=tiny_dataset(), eval_dataset=data, data_collator=DataCollator(0),
                               compute_metrics=batch_metrics, preprocess_logits_for_metrics=argmax).evaluate())
        assert calls == [("Tensor", 4, False), ("Tensor", 4, False), ("Tensor", 2, True)], name
    assert answers[0]["eval_accuracy"] == answers[1]["eval_accuracy"] == ours["eval_accuracy"]
    with pytest.raises(ConfigError, match="train.batch_eval_metrics: compute_metrics must take a compute_result"):
        Run({"train": {"batch_eval_metrics": True, "output_dir": str(tmp_path / "engine")}}, model=tiny_model(),
            train_dataset=tiny_dataset(), eval_dataset=data, data_collator=DataCollator(0),
            compute_metrics=_accuracy).evaluate()
    with pytest.raises(ConfigError, match="train.include_for_metrics: 'labels' is not one of 'inputs', 'loss'"):
        Run({"train": {"include_for_metrics": ["labels"]}})


def test_label_names_of_question_answering_as_trainer(tmp_path):
    def qa_model():
        torch.manual_seed(0)
        return transformers.LlamaForQuestionAnswering(tiny_model().config)

    generator = torch.Generator().manual_seed(4)
    data = [{"input_ids": row, "start_positions": start, "end_positions": start + 2}
            for row, start in zip(torch.randint(0, 128, (12, 16), generator=generator),
                                  torch.randint(0, 13, (12,), generator=generator))]

    def hits(prediction):
        predictions, labels = prediction
        if isinstance(labels, tuple):  # Trainer's default label_names: start_positions, end_positions
            return {"start": float(numpy.mean(predictions[0].argmax(-1) == labels[0])),
                    "end": float(numpy.mean(predictions[1].argmax(-1) == labels[1])), "sum": int(labels[1].sum())}
        return {"sum": int(labels.sum())}  # label_names = ["end_positions"]

    for label_names in (None, ["end_positions"]):
        trainer = transformers.Trainer(
            model=qa_model(), eval_dataset=data, data_collator=transformers.default_data_collator,
            compute_metrics=hits,
            args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=4,
                                                use_cpu=True, report_to="none", label_names=label_names))
        theirs = trainer.evaluate()
        train = {"per_device_eval_batch_size": 4, "output_dir": str(tmp_path / "engine")}
        run = Run({"train": train if label_names is None else {**train, "label_names": label_names}},
                  model=qa_model(), train_dataset=data, eval_dataset=data,
                  data_collator=transformers.default_data_collator, compute_metrics=hits)
        ours = run.evaluate()
        compared = ("eval_loss", "eval_start", "eval_end", "eval_sum")
        assert {k: ours[k] for k in compared if k in theirs} == pytest.approx(
            {k: theirs[k] for k in compared if k in theirs}, abs=1e-5)
        assert "eval_sum" in ours and ("eval_start" in ours) == (label_names is None)
    predicted = run.predict(data)
    assert numpy.array_equal(predicted.label_ids, numpy.array([int(row["end_positions"]) for row in data]))
    assert isinstance(predicted.predictions, tuple) and predicted.predictions[0].shape == (12, 16)  # start, end


def test_full_eval_in_bf16_and_fp16_as_trainer(tmp_path):
    data = tiny_dataset(12, seed=3)
    losses = {}
    for mode, dtype in (("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16), (None, torch.float32)):
        flags = {mode: True} if mode else {}
        trainer = transformers.Trainer(
            model=tiny_model(), eval_dataset=data, data_collator=DataCollator(0),
            args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=4,
                                                use_cpu=True, report_to="none", remove_unused_columns=False, **flags))
        theirs = trainer.evaluate()
        run = Run({"train": {"per_device_eval_batch_size": 4, "output_dir": str(tmp_path / "engine"), **flags}},
                  model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=data, data_collator=DataCollator(0))
        losses[dtype] = run.evaluate()["eval_loss"]
        assert losses[dtype] == pytest.approx(theirs["eval_loss"], abs=1e-5), mode
        assert run.model.dtype == trainer.model.dtype == dtype  # cast in place, as Trainer
    assert losses[torch.bfloat16] != losses[torch.float32] != losses[torch.float16]
    with pytest.raises(ConfigError, match="train.bf16_full_eval and train.fp16_full_eval are both true"):
        Run({"train": {"bf16_full_eval": True, "fp16_full_eval": True}})


def _first_tokens(model):
    """Records the first token of each training row the model sees: the data order."""
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.extend(kwargs["input_ids"][:, 0].tolist())
                                    if module.training else None, with_kwargs=True)
    return seen


def test_logging_evaluation_tokens_and_data_order_as_trainer(tmp_path, monkeypatch):
    import engine.builtin.memory

    shared = dict(max_steps=12, per_device_train_batch_size=8, per_device_eval_batch_size=8, learning_rate=1e-3,
                  logging_strategy="epoch", eval_strategy="steps", eval_steps=2, eval_delay=4, eval_on_start=True,
                  include_num_input_tokens_seen="non_padding", data_seed=5, save_strategy="no",
                  torch_empty_cache_steps=5)
    data, eval_data = tiny_dataset(ragged=True), tiny_dataset(8, seed=1)
    emptied = {"trainer": [], "engine": []}  # at which steps each empties the cache (a no-op on this CPU)
    monkeypatch.setattr(transformers.trainer, "clear_device_cache",
                        lambda: emptied["trainer"].append(trainer.state.global_step))
    monkeypatch.setattr(engine.builtin.memory, "empty_device_cache", lambda: emptied["engine"].append(run.state.global_step))
    model = tiny_model()
    their_order = _first_tokens(model)
    trainer = transformers.Trainer(
        model=model, train_dataset=data, eval_dataset=eval_data, data_collator=DataCollator(0),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, disable_tqdm=True, seed=1, **shared))
    trainer.train()
    model = tiny_model()
    our_order = _first_tokens(model)
    run = Run({"train": {"output_dir": str(tmp_path / "engine"), "disable_tqdm": True, "seed": 2, **shared}},
              model=model, train_dataset=data, eval_dataset=eval_data, data_collator=DataCollator(0))
    run.train()

    def steps_with(history, key):
        return [entry["step"] for entry in history if key in entry]

    theirs, ours = trainer.state.log_history, run.state.log_history
    assert steps_with(theirs, "loss") == steps_with(ours, "loss") == [8, 12]  # each epoch's end
    assert steps_with(theirs, "eval_loss") == steps_with(ours, "eval_loss") == [0, 4, 6, 8, 10, 12]
    assert run.state.num_input_tokens_seen == trainer.state.num_input_tokens_seen < 12 * 8 * 16  # padding left out
    assert [e["num_input_tokens_seen"] for e in theirs if "loss" in e] == [e["num_input_tokens_seen"] for e in ours
                                                                          if "loss" in e]
    assert our_order == their_order and len(our_order) == 12 * 8  # data_seed orders the data, not seed
    assert emptied["engine"] == emptied["trainer"] == [0, 5, 10]


def test_memory_metrics_measure_what_a_stage_keeps_and_peaks_at(tmp_path):
    import time

    from engine import hookimpl

    megabyte = 2**20

    class Hog:
        @hookimpl
        def on_train_start(self, run):
            self.kept = torch.ones(40 * megabyte // 4)  # kept after training: allocated

        @hookimpl
        def on_step_end(self, run):
            if run.state.global_step == 1:
                held = torch.ones(80 * megabyte // 4)  # freed within the step: a peak
                time.sleep(0.05)
                del held

    hog = Hog()
    run = Run({"train": {"max_steps": 2, "per_device_train_batch_size": 4, "save_strategy": "no",
                         "disable_tqdm": True, "skip_memory_metrics": False, "output_dir": str(tmp_path)}},
              model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(8, seed=1),
              data_collator=DataCollator(0), plugins=[hog])
    metrics = run.train()
    assert metrics["train_mem_cpu_alloc_delta"] >= 36 * megabyte, metrics
    assert metrics["train_mem_cpu_peaked_delta"] >= 72 * megabyte, metrics
    evaluated = run.evaluate()
    trainer = transformers.Trainer(
        model=tiny_model(), eval_dataset=tiny_dataset(8, seed=1), data_collator=DataCollator(0),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, skip_memory_metrics=False))
    theirs = {key for key in trainer.evaluate() if key.startswith("eval_mem")}  # and init_*: not in the engine
    assert {key for key in evaluated if "_mem_" in key} == theirs == {"eval_mem_cpu_alloc_delta",
                                                                     "eval_mem_cpu_peaked_delta"}
    assert not any("_mem_" in key for key in run.state.log_history[-1])  # returned, not logged, as Trainer
    assert "test_mem_cpu_peaked_delta" in run.predict(tiny_dataset(8, seed=1)).metrics


def test_logging_no_determinism_tf32_and_loader_options(tmp_path):
    quiet = run_steps(4, output_dir=tmp_path / "quiet", train={"logging_strategy": "no"})
    assert not [entry for entry in quiet.state.log_history if "loss" in entry]
    assert quiet.state.num_input_tokens_seen == 4 * 4 * 16

    options = dict(dataloader_num_workers=1, dataloader_persistent_workers=True, dataloader_prefetch_factor=3,
                   dataloader_multiprocessing_context="spawn", dataloader_in_order=False)
    run = Run({"train": {"output_dir": str(tmp_path / "engine"), "full_determinism": True, "tf32": False, **options}},
              model=tiny_model(), train_dataset=tiny_dataset())
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32
    try:
        run.setup()
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]
    trainer = transformers.Trainer(
        model=tiny_model(), train_dataset=tiny_dataset(),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, **options))
    theirs = trainer.get_train_dataloader()
    for attribute in ("num_workers", "persistent_workers", "prefetch_factor", "in_order", "pin_memory"):
        assert getattr(run.train_loader, attribute) == getattr(theirs, attribute), attribute
    assert run.train_loader.multiprocessing_context.get_start_method() == "spawn"
    with pytest.raises(ConfigError, match="train.dataloader_prefetch_factor needs worker processes"):
        Run({"train": {"dataloader_prefetch_factor": 2}})
    with pytest.raises(ConfigError, match="train.torch_empty_cache_steps"):
        Run({"train": {"torch_empty_cache_steps": 0}})


def test_use_cache_is_set_on_the_model_config_as_trainer_sets_it(tmp_path):
    import json

    for use_cache in (False, True):
        model = tiny_model()
        model.config.use_cache = not use_cache
        transformers.Trainer(model=model, args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none", use_cache=use_cache))
        engine_model = tiny_model()
        engine_model.config.use_cache = not use_cache
        out = tmp_path / f"engine-{use_cache}"
        run_steps(1, model=engine_model, output_dir=out, train={"use_cache": use_cache})
        assert engine_model.config.use_cache is model.config.use_cache is use_cache
        assert json.loads((out / "config.json").read_text())["use_cache"] is use_cache  # the saved model too


STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "rng_state.pt", "engine_state.pt", "scaler.pt")


def test_save_only_model_checkpoints_load_the_best_model_but_do_not_resume(tmp_path):
    from engine.kit.checkpoint import load_weights
    from engine.errors import CheckpointError

    train = {"save_only_model": True, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps",
             "eval_steps": 2, "load_best_model_at_end": True,
             "metric_for_best_model": "loss", "greater_is_better": True}  # the best: the first, not the last
    run = run_steps(6, output_dir=tmp_path / "engine", train=train, eval_dataset=tiny_dataset(8, seed=1))
    trainer = transformers.Trainer(
        model=tiny_model(), train_dataset=tiny_dataset(), data_collator=DataCollator(0),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, disable_tqdm=True, max_steps=2,
                                            save_steps=2, per_device_train_batch_size=4, save_only_model=True))
    trainer.train()
    theirs = {p.name for p in (tmp_path / "trainer" / "checkpoint-2").iterdir()}
    checkpoints = sorted((tmp_path / "engine").glob("checkpoint-*"))
    assert [p.name for p in checkpoints] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for folder in checkpoints:
        ours = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "config.json", "trainer_state.json"} <= ours & theirs
        assert not (ours | theirs) & set(STATE_FILES), ours | theirs  # what resuming would need
    best = run.state.best_model_checkpoint
    assert best == str(checkpoints[0])
    expected = tiny_model(seed=3)
    load_weights(expected, best)
    assert same_weights(run.model, expected) == []  # load_best_model_at_end loaded it
    with pytest.raises(CheckpointError, match="can't resume from a save_only_model checkpoint"):
        run_steps(8, output_dir=tmp_path / "engine", train={**train, "resume_from_checkpoint": True},
                  eval_dataset=tiny_dataset(8, seed=1))


def test_ignore_data_skip_resumes_with_the_epochs_data_from_its_start_as_trainer(tmp_path):
    shared = dict(per_device_train_batch_size=8, learning_rate=1e-3, data_seed=5, logging_steps=1,
                  save_strategy="steps", save_steps=3)
    resumed = dict(max_steps=10, ignore_data_skip=True)
    orders = {}
    for name in ("trainer", "engine"):
        for part in ("first", "resumed"):
            model = tiny_model()
            orders[name, part] = _first_tokens(model)
            values = {**shared, **(resumed if part == "resumed" else {"max_steps": 3})}
            folder = str(tmp_path / name)
            if name == "trainer":
                trainer = transformers.Trainer(
                    model=model, train_dataset=tiny_dataset(), data_collator=DataCollator(0),
                    args=transformers.TrainingArguments(output_dir=folder, use_cpu=True, report_to="none",
                                                        remove_unused_columns=False, disable_tqdm=True, **values))
                trainer.train(resume_from_checkpoint=part == "resumed" or None)
                state = trainer.state
            else:
                run = Run({"train": {"output_dir": folder, "disable_tqdm": True,
                                     "resume_from_checkpoint": part == "resumed", **values}},
                          model=model, train_dataset=tiny_dataset(), data_collator=DataCollator(0))
                run.train()
                state = run.state
        assert state.global_step == 10 and state.epoch == pytest.approx(7 / 8)  # 7 batches of the 8 in the epoch
    assert orders["engine", "first"] == orders["trainer", "first"]
    assert orders["engine", "resumed"] == orders["trainer", "resumed"] == orders["engine", "first"] + \
        orders["engine", "resumed"][24:]  # the epoch again from its first batch: 7 batches, not 7 after the 3
    assert len(orders["engine", "resumed"]) == 7 * 8


JIT_RUN = """
[train]
model = "tiny-llama"
output_dir = "{out}"
max_steps = 20
per_device_train_batch_size = 4
learning_rate = 1e-3
logging_steps = 1
save_strategy = "no"
enable_jit_checkpoint = true
disable_tqdm = true

[data]
train = "{corpus}"
max_length = 32
tokenizer = "train"
tokenizer_vocab_size = 300
"""


def test_sigterm_with_enable_jit_checkpoint_saves_and_resumes_like_an_uninterrupted_run(tmp_path, capfd):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from engine.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"record {i}: the quick brown fox {i % 7} jumps over {i % 13} dogs" for i in range(400)))
    files = {}
    for name in ("reference", "stopped"):
        files[name] = tmp_path / f"{name}.toml"
        files[name].write_text(JIT_RUN.format(out=tmp_path / name, corpus=corpus))
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    with open(tmp_path / "stopped.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "engine", "train", str(files["stopped"])], stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline and (
                not metrics.exists() or metrics.read_text().count('"loss"') < 3):
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=300) == 143
    text = (tmp_path / "stopped.log").read_text()
    assert "Traceback" not in text, text
    checkpoints = sorted((tmp_path / "stopped").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and f"saved {checkpoints[0]}" in text, text
    step = int(checkpoints[0].name.split("-")[1])
    assert 3 <= step < 20
    record = json.loads((tmp_path / "stopped" / "run.json").read_text())
    assert record["status"] == "interrupted"
    assert not (tmp_path / "stopped" / "model.safetensors").exists()  # no final model for a stopped run

    assert main(["train", str(files["stopped"]), "--set", "train.resume_from_checkpoint=true"]) == 0
    assert f"resumed from {checkpoints[0]} (step {step})" in capfd.readouterr().err
    assert main(["train", str(files["reference"])]) == 0
    expected, actual = (load_file(tmp_path / name / "model.safetensors") for name in ("reference", "stopped"))
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_a_trainingarguments_name_that_is_no_train_key_gets_the_tables_answer():
    with pytest.raises(ConfigError) as refused:
        Run({"train": {"local_rank": 0}})
    assert str(refused.value).startswith("train.local_rank: not a [train] key; TrainingArguments.local_rank: "
                                         "refused: the engine reads LOCAL_RANK")
    assert "did you mean" not in str(refused.value)
    with pytest.raises(ConfigError, match="train.neftune_noise_alpha: not a \\[train\\] key; .*provided by plugin "
                                          "neftune"):
        Run({"train": {"neftune_noise_alpha": 5.0}})


def test_check_raw_config_answers_before_the_sections_are_validated():
    """The table's answer is the builtin trainer_args' check_raw_config; a plugin's own answers before
    the schema's "unknown key" too."""
    import engine

    class Renames:
        @engine.hookimpl
        def check_raw_config(self, raw):
            if "lr" in raw.get("train", {}):
                raise ConfigError("train.lr: write train.learning_rate")

    with pytest.raises(ConfigError, match="^train.lr: write train.learning_rate$"):
        Run({"train": {"lr": 0.1}}, plugins=[Renames()])
    with pytest.raises(ConfigError, match="train.local_rank: not a \\[train\\] key"):
        Run({"train": {"local_rank": 0}}, plugins=[Renames()])
    with pytest.raises(ConfigError, match="train.sortish_sampler: not a \\[train\\] key; Seq2SeqTrainingArguments"
                                          ".sortish_sampler: the engine always does what Trainer's default does: "
                                          "Seq2SeqTrainer reads it nowhere"):
        Run({"train": {"sortish_sampler": True}})
    with pytest.raises(ConfigError, match="train.group_by_length: not a \\[train\\] key; .*accepted as \\[train\\] "
                                          "train_sampling_strategy"):
        Run({"train": {"group_by_length": True}})


def _with_extra_columns(size, ragged=True):
    """Token rows as a datasets.Dataset with an int and a string column that no model takes."""
    import datasets

    rows = tiny_dataset(size, ragged=ragged)
    return datasets.Dataset.from_list([{"input_ids": rows[i]["input_ids"].tolist(), "idx": i, "source": f"doc {i}"}
                                       for i in range(size)])


def test_remove_unused_columns_as_trainer(tmp_path):
    data, eval_rows = _with_extra_columns(16), list(_with_extra_columns(6, ragged=False))  # a list: the collator path
    shared = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-2, logging_steps=1,
                  max_steps=3, data_seed=5, save_strategy="no", disable_tqdm=True)
    keys, losses, evaluated = {}, {}, {}
    for remove in (True, False):
        for name in ("trainer", "engine"):
            seen = keys.setdefault((name, remove), set())

            def collator(features, seen=seen):
                seen.update(features[0])
                return DataCollator(0)(features)

            folder = str(tmp_path / f"{name}-{remove}")
            if name == "trainer":
                runner = transformers.Trainer(
                    model=tiny_model(), train_dataset=data, eval_dataset=eval_rows, data_collator=collator,
                    args=transformers.TrainingArguments(output_dir=folder, use_cpu=True, report_to="none",
                                                        remove_unused_columns=remove, **shared))
            else:
                runner = Run({"train": {"output_dir": folder, "remove_unused_columns": remove, **shared}},
                             model=tiny_model(), train_dataset=data, eval_dataset=eval_rows, data_collator=collator)
            if remove:  # trained and evaluated; without: the keys of a train and an eval batch
                runner.train()
                losses[name] = [entry["loss"] for entry in runner.state.log_history if "loss" in entry]
                evaluated[name] = runner.evaluate()["eval_loss"]
            elif name == "trainer":
                next(iter(runner.get_train_dataloader()))
                next(iter(runner.get_eval_dataloader()))
            else:
                runner.setup()
                next(iter(runner.train_loader))
                runner.evaluate()
        assert keys["engine", remove] == keys["trainer", remove], remove
    assert keys["engine", True] == {"input_ids"} and keys["engine", False] == {"input_ids", "idx", "source"}
    assert len(losses["engine"]) == 3 and losses["engine"] == pytest.approx(losses["trainer"], abs=1e-4)
    assert evaluated["engine"] == pytest.approx(evaluated["trainer"], abs=1e-5)
    model = tiny_model()  # a dataset the engine does not tokenize that has no column the model takes
    with pytest.raises(ConfigError, match="train.remove_unused_columns: no column of the train dataset "
                                          "\\(idx, source\\) is an argument of LlamaForCausalLM.forward"):
        without_unused_columns(data.remove_columns("input_ids"), DataCollator(0), forward_columns(model, ["labels"]),
                               model, "train dataset")


def test_group_by_length_is_trainers_grouping_of_a_seeded_shuffle(tmp_path):
    from transformers.trainer_pt_utils import get_length_grouped_indices

    rows = tiny_dataset(48, ragged=True)
    data = [{"input_ids": rows[i]["input_ids"], "idx": i} for i in range(48)]  # DataCollator stacks idx
    lengths = [len(row["input_ids"]) for row in data]
    train = {"train_sampling_strategy": "group_by_length", "per_device_train_batch_size": 4, "seed": 7}

    # Trainer shuffles with the global RNG (data_seed does not seed it): at the first epoch, the state
    # set_seed(seed) left, after the DataLoader drew its base seed from it
    trainer = transformers.Trainer(
        model=tiny_model(), train_dataset=data, data_collator=DataCollator(0),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, data_seed=5, **train))
    theirs = torch.cat([batch["idx"] for batch in trainer.get_train_dataloader()]).tolist()
    generator = torch.Generator().manual_seed(7)
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    assert theirs == get_length_grouped_indices(lengths, 4, generator=generator)

    # the engine: the same grouping of its own shuffle, seeded by data_seed + epoch; batch x accumulation per group
    def engine_order(epoch, **values):
        run = Run({"train": {**train, "output_dir": str(tmp_path / "engine"), "remove_unused_columns": False,
                             **values}}, model=tiny_model(), train_dataset=data, data_collator=DataCollator(0))
        run.setup()
        run.train_loader.sampler.set_epoch(epoch)
        return torch.cat([batch["idx"] for batch in run.train_loader]).tolist()

    first = engine_order(0, data_seed=5, gradient_accumulation_steps=2)
    for epoch, order in ((0, first), (1, engine_order(1, data_seed=5, gradient_accumulation_steps=2))):
        assert order == get_length_grouped_indices(lengths, 8, generator=torch.Generator().manual_seed(5 + epoch))
        assert sorted(order) == list(range(48))  # every example once per epoch
        assert lengths[order[0]] == max(lengths)  # the longest first
        for start in range(0, 48, 8):  # 48 // (4 * 8) = 1 batch of 8 per megabatch, sorted longest first
            megabatch = [lengths[i] for i in order[start:start + 8]][1 if start == 0 else 0:]
            assert megabatch == sorted(megabatch, reverse=True)
    assert engine_order(0, data_seed=5, gradient_accumulation_steps=2) == first  # deterministic
    assert engine_order(0, data_seed=6, gradient_accumulation_steps=2) != first
    assert engine_order(0, data_seed=5) == get_length_grouped_indices(  # megabatches of 48 // 16 = 3 batches of 4
        lengths, 4, generator=torch.Generator().manual_seed(5))


def test_group_by_length_resumes_exactly_and_reads_the_length_column(tmp_path):
    import datasets
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from engine.testing import assert_resume_is_exact

    train = {"train_sampling_strategy": "group_by_length", "data_seed": 3}
    assert_resume_is_exact(6, 3, tmp_path, train=train, dataset=tiny_dataset(16, ragged=True))  # over an epoch's end

    rows = tiny_dataset(12, ragged=True)
    sizes = list(range(12, 0, -1))
    data = datasets.Dataset.from_dict({"input_ids": [rows[i]["input_ids"].tolist() for i in range(12)], "size": sizes})
    run = Run({"train": {**train, "length_column_name": "size", "per_device_train_batch_size": 4,
                         "output_dir": str(tmp_path / "column")}},
              model=tiny_model(), train_dataset=data, data_collator=DataCollator(0))
    run.setup()
    assert run.train_loader.sampler.lengths == sizes  # read before remove_unused_columns drops the column
    assert set(next(iter(run.train_loader))) == {"input_ids", "labels", "attention_mask"}
    order = list(run.train_loader.sampler)
    assert order[0] == 0 and order == get_length_grouped_indices(sizes, 4, generator=torch.Generator().manual_seed(3))


def test_bad_sampling_and_column_values_are_one_line_errors(capfd):
    import subprocess

    from engine.cli import main
    from engine.testing import assert_one_line_error

    for setting, fragment in (
            ("train.train_sampling_strategy=batch_rebalance",
             ("train.train_sampling_strategy: expected 'random' | 'sequential' | 'group_by_length', got str "
              "'batch_rebalance'")),
            ("train.eval_accumulation_steps=0", "train.eval_accumulation_steps: expected int >= 1, got 0"),
            ("train.remove_unused_columns=1", "train.remove_unused_columns: expected bool, got int 1"),
            ("train.length_column_name=''", "train.length_column_name: expected a non-empty string")):
        status = main(["plan", "--set", setting])
        captured = capfd.readouterr()
        assert_one_line_error(subprocess.CompletedProcess(["engine"], status, captured.out, captured.err), fragment)


def test_eval_accumulation_steps_gives_trainers_metrics(tmp_path):
    def metrics(prediction):  # ragged rows: batches of other widths, padded when concatenated
        predictions, labels = prediction
        return {**_accuracy((predictions.argmax(-1), labels)), "padded": int((labels == -100).sum()),
                "logits_sum": float(numpy.abs(predictions[predictions != -100]).sum())}

    data = tiny_dataset(10, seed=3, ragged=True)  # batches of 4, 4 and 2
    trainer = transformers.Trainer(
        model=tiny_model(), eval_dataset=data, data_collator=DataCollator(0), compute_metrics=metrics,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=4,
                                            eval_accumulation_steps=2, use_cpu=True, report_to="none"))
    theirs = trainer.evaluate()
    for steps in (2, None):
        ours = Run({"train": {"per_device_eval_batch_size": 4, "eval_accumulation_steps": steps,
                              "output_dir": str(tmp_path / "engine")}},
                   model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=data, data_collator=DataCollator(0),
                   compute_metrics=metrics).evaluate()
        assert (ours["eval_accuracy"], ours["eval_padded"]) == (theirs["eval_accuracy"], theirs["eval_padded"])
        assert ours["eval_logits_sum"] == pytest.approx(theirs["eval_logits_sum"], rel=1e-6)
    assert theirs["eval_padded"] > 0


def test_save_strategy_best_saves_at_the_evaluations_trainer_saves_at(tmp_path):
    args = dict(max_steps=12, per_device_train_batch_size=4, learning_rate=3.0, logging_steps=1, eval_strategy="steps",
                eval_steps=2, save_strategy="best", metric_for_best_model="loss", optim="sgd")
    data, evaluation = tiny_dataset(), tiny_dataset(8, seed=1)
    trainer = transformers.Trainer(
        model=tiny_model(), train_dataset=data, eval_dataset=evaluation, data_collator=DataCollator(0),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, disable_tqdm=True, **args))
    trainer.train()
    run = Run({"train": {"output_dir": str(tmp_path / "engine"), "disable_tqdm": True, **args}},
              model=tiny_model(), train_dataset=data, eval_dataset=evaluation, data_collator=DataCollator(0))
    run.train()
    saved = [sorted(int(p.name.split("-")[1]) for p in (tmp_path / name).glob("checkpoint-*"))
             for name in ("trainer", "engine")]
    evaluations = [[(e["step"], round(e["eval_loss"], 4)) for e in history if "eval_loss" in e]
                   for history in (trainer.state.log_history, run.state.log_history)]
    assert evaluations[0] == evaluations[1]
    assert saved[0] == saved[1] and 0 < len(saved[1]) < 6  # the improving evaluations only
    with pytest.raises(ConfigError, match="save_strategy = 'best' saves after evaluations that improve"):
        Run({"train": {"save_strategy": "best"}})
