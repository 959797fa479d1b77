"""Run.hyperparameter_search: Trainer's search (optuna, ray), each trial an ordinary run in output_dir/run-<n>."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import transformers

from engine import Run
from engine.builtin.data.collators import DataCollator
from engine.errors import ConfigError
from engine.testing import tiny_dataset, tiny_model

optuna = pytest.importorskip("optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)

# data_seed and adamw_torch: the engine's full fine-tuning equals Trainer's step by step
SCHEDULE = dict(max_steps=4, per_device_train_batch_size=4, per_device_eval_batch_size=4, eval_strategy="steps",
                eval_steps=2, save_strategy="no", logging_steps=1, disable_tqdm=True, data_seed=5, optim="adamw_torch")
DATA, EVAL_DATA = tiny_dataset(32), tiny_dataset(8, seed=1)
TOLERANCE = 1e-6  # the engine's eval_loss is rounded to 6 decimals


def fresh_model():
    return tiny_model()


def make_run(tmp_path, dataset=DATA, **train):
    return Run({"train": {**SCHEDULE, "output_dir": str(tmp_path / "engine"), **train}}, model_init=fresh_model,
               train_dataset=dataset, eval_dataset=EVAL_DATA, data_collator=DataCollator(0))


def learning_rate_and_warmup(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
            "warmup_steps": trial.suggest_int("warmup_steps", 0, 3)}


def tried(storage, study_name):
    return [(trial.params, trial.value) for trial in optuna.load_study(study_name=study_name, storage=storage).trials]


def run_record(folder):
    return json.loads((folder / "run.json").read_text())


def test_the_search_tries_trainers_parameters_and_gets_its_objectives(tmp_path):
    storage = optuna.storages.InMemoryStorage()  # to read every trial back: both searches create their study in it
    trainer = transformers.Trainer(
        model_init=fresh_model, train_dataset=DATA, eval_dataset=EVAL_DATA, data_collator=DataCollator(0),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                            remove_unused_columns=False, **SCHEDULE))
    theirs = trainer.hyperparameter_search(learning_rate_and_warmup, n_trials=3, backend="optuna", storage=storage,
                                           study_name="trainer", sampler=optuna.samplers.TPESampler(seed=0))
    ours = make_run(tmp_path).hyperparameter_search(learning_rate_and_warmup, n_trials=3, backend="optuna",
                                                    storage=storage, study_name="engine",
                                                    sampler=optuna.samplers.TPESampler(seed=0))
    their_trials, our_trials = tried(storage, "trainer"), tried(storage, "engine")
    assert [params for params, _ in our_trials] == [params for params, _ in their_trials]
    assert len({params["learning_rate"] for params, _ in our_trials}) == 3
    for (_, our_value), (_, their_value) in zip(our_trials, their_trials):
        assert our_value == pytest.approx(their_value, rel=TOLERANCE)
    assert isinstance(ours, transformers.trainer_utils.BestRun)
    assert (ours.run_id, ours.hyperparameters, ours.run_summary) == (theirs.run_id, theirs.hyperparameters, None)
    assert ours.objective == pytest.approx(theirs.objective, rel=TOLERANCE)
    for number in range(3):  # each trial an ordinary run in its own folder
        folder = tmp_path / "engine" / f"run-{number}"
        assert run_record(folder)["status"] == "finished"
        assert (folder / "metrics.jsonl").exists()


def test_a_diverging_trial_is_pruned_at_its_first_evaluation_and_the_search_goes_on(tmp_path):
    rates = [1e-3, 1.0, 3e-3]  # this grid sampler's order: a good rate, a diverging one, a better one

    def space(trial):
        return {"learning_rate": trial.suggest_categorical("learning_rate", rates)}

    storage = optuna.storages.InMemoryStorage()
    best = make_run(tmp_path).hyperparameter_search(
        space, n_trials=3, storage=storage, study_name="pruning",
        sampler=optuna.samplers.GridSampler({"learning_rate": rates}, seed=5),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    trials = optuna.load_study(study_name="pruning", storage=storage).trials
    assert [trial.params["learning_rate"] for trial in trials] == rates
    assert [trial.state.name for trial in trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert list(trials[1].intermediate_values) == [2]
    assert (best.run_id, best.hyperparameters) == ("2", {"learning_rate": 3e-3})
    pruned = tmp_path / "engine" / "run-1"
    assert run_record(pruned)["status"] == "pruned"
    logged = [json.loads(line) for line in (pruned / "metrics.jsonl").read_text().splitlines()]
    assert max(record["step"] for record in logged) == 2
    assert [record["step"] for record in logged if "eval_loss" in record] == [2]
    assert [run_record(tmp_path / "engine" / f"run-{n}")["status"] for n in (0, 2)] == ["finished", "finished"]


def test_several_directions_give_trainers_list_of_best_runs(tmp_path):
    def loss_both_ways(metrics):  # opposite directions on the same value: every trial is on the Pareto front
        return [metrics["eval_loss"], metrics["eval_loss"]]

    best = make_run(tmp_path).hyperparameter_search(
        learning_rate_and_warmup, compute_objective=loss_both_ways, n_trials=2, direction=["minimize", "maximize"],
        sampler=optuna.samplers.RandomSampler(seed=0))
    assert isinstance(best, list) and sorted(run.run_id for run in best) == ["0", "1"]
    for run in best:
        assert isinstance(run, transformers.trainer_utils.BestRun)
        assert len(run.objective) == 2 and run.objective[0] == run.objective[1]
        assert set(run.hyperparameters) == {"learning_rate", "warmup_steps"}


def test_trainers_default_space_reaches_the_trial_as_train_keys_in_the_folder_hp_name_names(tmp_path):
    def name(trial):
        return f"lr-{trial.params['learning_rate']:.3e}"

    best = make_run(tmp_path, tiny_dataset(64)).hyperparameter_search(  # batches of up to 64 in that space
        n_trials=1, hp_name=name, sampler=optuna.samplers.RandomSampler(seed=0))
    space = transformers.trainer_utils.default_hp_space_optuna(optuna.trial.FixedTrial(best.hyperparameters))
    assert best.hyperparameters == space  # Trainer's default space: its keys are TrainingArguments names
    folder = tmp_path / "engine" / f"lr-{best.hyperparameters['learning_rate']:.3e}"
    train = json.loads((folder / "hyperparams.json").read_text())["train"]
    # each value set as Trainer sets it, cast to the run's type (num_train_epochs is a float)
    assert {key: train[key] for key in space} == {**space, "num_train_epochs": float(space["num_train_epochs"])}
    assert isinstance(train["num_train_epochs"], float) and run_record(folder)["status"] == "finished"


def test_bad_input_is_one_line_before_any_trial_trains(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^Run.hyperparameter_search: pass Run\(model_init=...\)"):
        Run({"train": {"output_dir": str(tmp_path)}}, model=tiny_model()).hyperparameter_search(backend="optuna")
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="Run\\(optimizers=...\\) holds one model's parameters"):
        Run(model_init=fresh_model, optimizers=(optimizer, None)).hyperparameter_search(backend="optuna")
    with pytest.raises(ConfigError, match="unknown backend 'grid'; choose 'optuna' or 'ray'"):
        make_run(tmp_path).hyperparameter_search(backend="grid")
    with pytest.raises(ConfigError, match="backend 'wandb' is not supported \\(W&B sweeps need the W&B server\\)"):
        make_run(tmp_path).hyperparameter_search(backend="wandb")
    with pytest.raises(ConfigError, match="several objectives need backend='optuna'"):
        make_run(tmp_path).hyperparameter_search(backend="ray", direction=["minimize", "maximize"])
    monkeypatch.setitem(sys.modules, "ray", None)  # not installed, as Python's import system sees it
    with pytest.raises(ConfigError, match=re.escape("backend 'ray' is not installed: pip install 'engine[ray]'")):
        make_run(tmp_path).hyperparameter_search(backend="ray")

    def unknown_key(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2), "learning_rat": 0.1}

    with pytest.raises(ConfigError, match="learning_rat") as refused:
        make_run(tmp_path).hyperparameter_search(unknown_key, n_trials=2)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "engine" / "run-0" / "run.json").exists()
    no_evaluation = Run({"train": {**SCHEDULE, "eval_strategy": "no", "output_dir": str(tmp_path / "no-eval")}},
                        model_init=fresh_model, train_dataset=DATA, data_collator=DataCollator(0))
    with pytest.raises(ConfigError, match="objective comes from an evaluation, but the run has no evaluation data"):
        no_evaluation.hyperparameter_search(learning_rate_and_warmup, n_trials=1)
    assert not (tmp_path / "no-eval").exists()
    with pytest.raises(ConfigError, match="train.ray_scope"):  # Trainer's ray_scope: a [train] key, checked
        make_run(tmp_path, ray_scope="best")


def test_ray_tune_trials_equal_optunas_for_the_same_parameters(tmp_path):
    ray = pytest.importorskip("ray")
    from ray import tune

    rates = [1e-3, 1e-2]
    storage = optuna.storages.InMemoryStorage()
    make_run(tmp_path / "optuna").hyperparameter_search(
        lambda trial: {"learning_rate": trial.suggest_categorical("learning_rate", rates)}, n_trials=2,
        storage=storage, study_name="grid", sampler=optuna.samplers.GridSampler({"learning_rate": rates}))
    by_optuna = {params["learning_rate"]: value for params, value in tried(storage, "grid")}

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        best = make_run(tmp_path / "ray", ray_scope="all").hyperparameter_search(
            lambda trial: {"learning_rate": tune.grid_search(rates)}, n_trials=1, backend="ray",
            resources_per_trial={"cpu": 1}, verbose=0)
    finally:
        ray.shutdown()
    by_ray = {result.config["learning_rate"]: result.metrics["objective"] for result in best.run_summary}
    assert by_ray.keys() == by_optuna.keys()
    for rate, value in by_optuna.items():
        assert by_ray[rate] == pytest.approx(value, rel=TOLERANCE)
    assert best.hyperparameters == {"learning_rate": 1e-2} and best.objective == by_ray[1e-2]
    folders = sorted((tmp_path / "ray" / "engine").glob("run-*"))
    assert [run_record(folder)["status"] for folder in folders] == ["finished", "finished"]
    assert f"run-{best.run_id}" in [folder.name for folder in folders]  # Trainer's name: run-<Ray's trial id>
