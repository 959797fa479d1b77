"""The loop against references: accumulation, schedulers, losses, evaluation, control flow."""

import json
import math

import pytest
import torch

from engine import Run, hookimpl
from engine.builtin.data.collators import DataCollator
from engine.testing import logged_scalars, run_steps, tiny_dataset, tiny_model


def _params(run):
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}


# SGD's update is linear in the gradient: float noise stays at float noise. Adam divides by
# sqrt(v), which magnifies the last-bit differences of near-zero gradients: looser bound.
@pytest.mark.parametrize("optim, max_grad_norm, atol", [
    ("sgd", 0.0, 1e-7), ("sgd", 0.5, 1e-7), ("adamw_torch", 0.5, 2e-5)])
def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch(tmp_path, optim, max_grad_norm, atol):
    # ragged rows: padding makes the per-micro-batch token counts differ, which only a
    # window-wide normalisation (num_items_in_batch) gets right
    data = tiny_dataset(48, seq_len=12, ragged=True)
    common = {"learning_rate": 1e-2, "max_grad_norm": max_grad_norm, "optim": optim, "weight_decay": 0.1}
    big = run_steps(4, output_dir=tmp_path / "big", dataset=data,
                    train={**common, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1})
    small = run_steps(4, output_dir=tmp_path / "small", dataset=data,
                      train={**common, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4})
    for name, value in _params(big).items():
        torch.testing.assert_close(_params(small)[name], value, rtol=0, atol=atol, msg=name)
    big_losses = [e["loss"] for e in big.state.log_history if "loss" in e]
    small_losses = [e["loss"] for e in small.state.log_history if "loss" in e]
    assert small_losses == pytest.approx(big_losses, rel=1e-5)


def test_logged_loss_is_the_mean_token_loss_of_the_step(tmp_path):
    data = tiny_dataset(8, seq_len=12, ragged=True)
    model = tiny_model()
    batch = DataCollator(0)([data[i] for i in range(8)])
    expected = model(**batch).loss.item()  # HF mean over the batch's shifted label tokens
    run = run_steps(1, output_dir=tmp_path, dataset=data, model=model,
                    train={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                           "learning_rate": 0.0})
    # same 8 rows in another order: the window mean over all tokens is order independent
    assert run.state.log_history[0]["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name, kwargs", [
    ("linear", {}), ("cosine", {}), ("constant", {}), ("constant_with_warmup", {}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-4}), ("cosine", {"num_cycles": 1.5}),
])
def test_scheduler_values_match_transformers(name, kwargs):
    from transformers import get_scheduler

    run = Run({"train": {"lr_scheduler_type": name, "lr_scheduler_kwargs": kwargs, "learning_rate": 1e-2}})
    total, warmup = 40, 7

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)

    ours_opt, ref_opt = optimizer(), optimizer()
    entry = run.registries["scheduler"].get(name)
    ours = entry.factory(ours_opt, warmup, total, **kwargs)
    ref = get_scheduler(name, ref_opt, num_warmup_steps=warmup, num_training_steps=total,
                        scheduler_specific_kwargs=kwargs)
    for _ in range(total + 3):
        assert ours.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0], rel=1e-12, abs=1e-15)
        ours_opt.step(), ref_opt.step()
        ours.step(), ref.step()


def test_warmup_ratio_and_logged_learning_rate(tmp_path):
    run = run_steps(10, output_dir=tmp_path, train={"warmup_ratio": 0.2, "learning_rate": 1e-2,
                                                    "lr_scheduler_type": "linear"})
    assert run.num_warmup_steps == 2
    lrs = [e["learning_rate"] for e in run.state.log_history if "loss" in e]
    # the lr logged at step s is the one used for that step
    expected = [1e-2 * s / 2 if s < 2 else 1e-2 * (10 - s) / 8 for s in range(10)]
    assert lrs == pytest.approx(expected)


def test_label_smoothing_matches_the_hf_label_smoother(tmp_path):
    from transformers.trainer_pt_utils import LabelSmoother

    data = tiny_dataset(8, ragged=True)
    model = tiny_model()
    batch = DataCollator(0)([data[i] for i in range(4)])
    run = Run({"train": {"label_smoothing_factor": 0.1, "output_dir": str(tmp_path)}}, model=model,
              train_dataset=data, data_collator=DataCollator(0))
    run.setup()
    ours = run.hook.compute_loss(run=run, model=model, batch=batch, num_items_in_batch=None)
    reference = LabelSmoother(epsilon=0.1)(model(input_ids=batch["input_ids"],
                                                 attention_mask=batch["attention_mask"]),
                                           batch["labels"], shift_labels=True)
    torch.testing.assert_close(ours, reference)


def test_model_without_loss_gets_token_cross_entropy(tmp_path):
    class Bigram(torch.nn.Module):  # plain module: no labels argument, returns logits
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(128, 128)

        def forward(self, input_ids):
            return self.emb(input_ids)

    model = Bigram()
    data = tiny_dataset(32)
    run = run_steps(30, output_dir=tmp_path, model=model, dataset=data, train={"learning_rate": 0.5})
    losses = [e["loss"] for e in run.state.log_history if "loss" in e]
    assert losses[-1] < losses[0] - 1.0
    batch = DataCollator(0)([data[0]])
    expected = torch.nn.functional.cross_entropy(model(batch["input_ids"])[0], batch["labels"][0])
    got = run.hook.compute_loss(run=run, model=model, batch=batch, num_items_in_batch=None)
    torch.testing.assert_close(got, expected)  # aligned labels: not shifted for plain modules


def test_epochs_count_steps_like_trainer(tmp_path):
    data = tiny_dataset(20)
    run = run_steps(-1, output_dir=tmp_path, dataset=data,
                    train={"num_train_epochs": 2, "per_device_train_batch_size": 4,
                           "gradient_accumulation_steps": 2})
    # 5 batches per epoch, windows of 2 -> 3 optimizer steps per epoch (the last window has 1)
    assert run.state.steps_per_epoch == 3 and run.state.global_step == 6
    assert run.state.epoch == pytest.approx(2.0)


def test_iterable_dataset_needs_max_steps(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            data = tiny_dataset(16)
            return (data[i] for i in range(len(data)))

    run = run_steps(7, output_dir=tmp_path / "a", dataset=Stream())  # 4 batches per pass: two passes
    assert run.state.global_step == 7
    with pytest.raises(Exception, match="train.max_steps: an IterableDataset has no length"):
        run_steps(-1, output_dir=tmp_path / "b", dataset=Stream())


def test_evaluation_is_token_weighted_and_calls_compute_metrics(tmp_path):
    data = tiny_dataset(10, ragged=True, seed=3)
    seen = {}

    def compute_metrics(prediction):
        predictions, labels = prediction
        seen["shapes"] = (predictions.shape, labels.shape)
        return {"top1": float((predictions[:, :-1].argmax(-1) == labels[:, 1:]).mean())}

    model = tiny_model()
    run = Run({"train": {"output_dir": str(tmp_path), "per_device_eval_batch_size": 3}}, model=model,
              train_dataset=data, eval_dataset={"a": data, "b": tiny_dataset(4)},
              data_collator=DataCollator(0), compute_metrics=compute_metrics)
    metrics = run.evaluate()
    full = DataCollator(0)([data[i] for i in range(10)])
    with torch.no_grad():
        expected = model(**full).loss.item()  # mean over every shifted label token
    assert metrics["eval_a_loss"] == pytest.approx(expected, rel=1e-5)
    assert "eval_b_loss" in metrics and "eval_a_top1" in metrics
    assert seen["shapes"][0][:1] == (4,) and seen["shapes"][1] == (4, 16)  # last: dataset b


def test_default_run_config_evaluates_on_schedule(tmp_path):
    run = run_steps(6, output_dir=tmp_path, eval_dataset=tiny_dataset(8),
                    train={"eval_strategy": "steps", "eval_steps": 3})
    eval_steps = [e["step"] for e in run.state.log_history if "eval_loss" in e]
    assert eval_steps == [3, 6]


def test_a_plugin_can_stop_save_and_evaluate_through_control(tmp_path):
    class Controller:
        @hookimpl
        def on_step_end(self, run):
            if run.state.global_step == 2:
                run.control.should_evaluate = True
                run.control.should_save = True
            if run.state.global_step == 3:
                run.control.request_stop("enough")

    run = run_steps(10, objects=[Controller()], output_dir=tmp_path, eval_dataset=tiny_dataset(4))
    assert run.state.global_step == 3 and run.control.stop_reason == "enough"
    assert (tmp_path / "checkpoint-2" / "checkpoint_complete").is_file()
    assert [e["step"] for e in run.state.log_history if "eval_loss" in e] == [2]


def test_patch_model_undo_runs_when_training_ends(tmp_path):
    events = []

    class Patcher:
        @hookimpl
        def patch_model(self, run, model):
            handle = model.get_input_embeddings().register_forward_hook(lambda *a: events.append("fwd"))
            events.append("patched")
            return lambda: (handle.remove(), events.append("undone"))

    run = run_steps(2, objects=[Patcher()], output_dir=tmp_path)
    assert events[0] == "patched" and events[-1] == "undone" and events.count("fwd") == 2
    run.model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    assert events.count("fwd") == 2  # the hook is gone


def test_metrics_jsonl_has_one_object_per_log_event(tmp_path):
    run_steps(4, output_dir=tmp_path, train={"logging_steps": 2})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    for record in records[:2]:
        assert {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "step_time"} <= set(record)
        assert math.isfinite(record["loss"])
    assert records[-1]["train_runtime"] > 0
    assert json.loads((tmp_path / "hyperparams.json").read_text())["train"]["logging_steps"] == 2


def test_resume_continues_with_identical_parameters(tmp_path):
    common = {"save_strategy": "steps", "save_steps": 2, "gradient_accumulation_steps": 2}

    class Counter:
        """Plugin state that must survive a resume."""

        def __init__(self):
            self.steps = 0

        @hookimpl
        def on_step_end(self, run):
            self.steps += 1

        @hookimpl
        def checkpoint_state(self, run):
            return {"steps": self.steps}

        @hookimpl
        def load_checkpoint_state(self, run, state):
            self.steps = state["steps"]

    straight = run_steps(4, output_dir=tmp_path / "a", objects=[Counter()], train=common)
    first = Run({"plugins": [], "train": {"max_steps": 4, "per_device_train_batch_size": 4,
                                          "learning_rate": 1e-2, "disable_tqdm": True,
                                          "output_dir": str(tmp_path / "b"), **common}},
                model=tiny_model(), train_dataset=tiny_dataset(), data_collator=DataCollator(0),
                plugins=[Counter()])
    first.setup()

    class StopAtTwo:
        @hookimpl
        def on_step_end(self, run):
            if run.state.global_step == 2:
                run.control.request_stop("simulated interruption")

    first.plugin_manager.pm.register(StopAtTwo(), name="stop")
    first.train()
    assert first.state.global_step == 2
    counter = Counter()
    resumed = run_steps(4, output_dir=tmp_path / "b", objects=[counter],
                        train={**common, "resume_from_checkpoint": True})
    assert counter.steps == 4
    for name, value in _params(straight).items():
        torch.testing.assert_close(_params(resumed)[name], value, rtol=0, atol=0, msg=name)


def test_overwrite_output_dir_starts_a_fresh_history(tmp_path):
    run_steps(3, output_dir=tmp_path, train={"save_strategy": "steps", "save_steps": 1})
    run_steps(2, output_dir=tmp_path, train={"overwrite_output_dir": True})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert not list(tmp_path.glob("checkpoint-*"))  # the first run's checkpoints went with it


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    from engine import ConfigError

    run = Run({"train": {"output_dir": str(tmp_path)}, "data": {"tokenizer_vocab_size": 300}},
              model=tiny_model(vocab_size=128))
    with pytest.raises(ConfigError, match="the tokenizer has 300 tokens but the model's vocab_size is 128"):
        run.setup()


def test_the_end_of_training_hooks(tmp_path):
    """on_train_summary adds to the summary, on_before_final_save decides the final weights, on_train_exit
    fires last, also when training raised."""
    from safetensors.torch import load_file

    class EndOfTraining:
        def __init__(self, fail_at=None):
            self.fail_at, self.events = fail_at, []

        @hookimpl
        def on_step_end(self, run):
            if run.state.global_step == self.fail_at:
                raise RuntimeError("a plugin failed")

        @hookimpl
        def on_train_summary(self, run, metrics):
            metrics["train_custom"] = 1.0

        @hookimpl
        def on_before_final_save(self, run):
            self.events.append(("before_final_save", run.model.training))
            with torch.no_grad():
                run.model.model.norm.weight.zero_()  # what the final model then holds

        @hookimpl
        def on_train_end(self, run):
            self.events.append(("train_end", None))

        @hookimpl
        def on_train_exit(self, run, status):
            self.events.append(("train_exit", status))

    ended = EndOfTraining()
    run_steps(2, objects=[ended], output_dir=tmp_path / "ok", train={"save_final_model": True})
    assert logged_scalars(tmp_path / "ok")[("train_custom", 2)] == 1.0  # logged with the summary
    assert ended.events == [("before_final_save", False), ("train_end", None), ("train_exit", "success")]
    final = load_file(tmp_path / "ok" / "model.safetensors")
    assert not final["model.norm.weight"].any()

    failed = EndOfTraining(fail_at=1)
    with pytest.raises(RuntimeError, match="a plugin failed"):
        run_steps(2, objects=[failed], output_dir=tmp_path / "failed")
    assert failed.events == [("train_exit", "failed")]
