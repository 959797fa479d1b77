"""engine.tracking: what tracker plugins share (flattened config within limits, scalars, a sender thread)."""

import threading

import pytest

from engine.testing import run_steps
from engine.tracking import BackgroundSender, flatten_config, scalar_metrics, tracker_run_name


def test_flatten_config_gives_dotted_keys_and_plain_values():
    params = {"plugins": ["mlflow", "wandb"], "train": {"learning_rate": 0.1, "bf16": False, "run_name": None,
                                                        "model_config": {}, "optim_args": {"betas": [0.9, 0.99]}}}
    assert flatten_config(params) == {"plugins": '["mlflow", "wandb"]', "train.learning_rate": 0.1,
                                      "train.bf16": False, "train.run_name": "None", "train.model_config": "{}",
                                      "train.optim_args.betas": "[0.9, 0.99]"}


def test_flatten_config_keeps_within_limits_and_says_what_it_changed(caplog):
    params = {"train": {"note": "x" * 50, "short": "ok"}, "k" * 30: 1}
    with caplog.at_level("WARNING", logger="engine"):
        flat = flatten_config(params, max_key_length=20, max_value_length=10, tracker="mlflow")
    assert flat == {"train.note": "xxxxxxx...", "train.short": "ok"}
    assert caplog.messages == [f"mlflow: config keys longer than 20 characters are not logged: {'k' * 30}",
                               "mlflow: config values longer than 10 characters are cut short: train.note"]


def test_scalar_metrics_keeps_numbers_only():
    assert scalar_metrics({"loss": 1, "lr": 0.5, "done": True, "note": "x", "nan": float("nan")})["loss"] == 1.0
    assert set(scalar_metrics({"loss": 1, "lr": 0.5, "done": True, "note": "x"})) == {"loss", "lr"}


def test_tracker_run_name_is_run_name_or_the_output_folder(tmp_path):
    assert tracker_run_name(run_steps(1, output_dir=tmp_path / "my-run")) == "my-run"
    assert tracker_run_name(run_steps(1, output_dir=tmp_path / "b", train={"run_name": "named"})) == "named"


def test_background_sender_sends_in_order_off_the_calling_thread():
    sent, threads = [], set()
    sender = BackgroundSender("test")
    for i in range(50):
        sender.submit(lambda i=i: (sent.append(i), threads.add(threading.get_ident())))
    sender.close()
    assert sent == list(range(50)) and threading.get_ident() not in threads


def test_background_sender_raises_a_failure_once_and_sends_nothing_after_it():
    sent, failed = [], threading.Event()

    def fail():
        failed.set()
        raise ConnectionError("server gone")

    sender = BackgroundSender("test")
    sender.submit(fail)
    failed.wait(10)
    sender._queue.join()  # the failure is recorded before the next call
    with pytest.raises(ConnectionError, match="server gone"):
        sender.submit(lambda: sent.append(1))
    sender.submit(lambda: sent.append(2))  # reported already: the caller was switched off
    sender.close()
    assert sent == []


def test_background_sender_close_reports_a_failure_of_the_last_calls():
    sender = BackgroundSender("test")
    sender.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sender.close()


@pytest.mark.parametrize("extra, install", [("mlflow", "pip install 'engine[mlflow]'"),
                                            ("thirdparty", "pip install not-here-client")])
def test_a_tracker_without_its_package_names_what_to_install(extra, install):
    from dataclasses import dataclass

    from engine import Run
    from engine.errors import MissingDependencyError
    from engine.tracking import Tracker

    @dataclass
    class Options:
        pass

    class Missing(Tracker):
        package, distribution, options = "not_here_xyz", "not-here-client", Options

    Missing.extra = extra
    with pytest.raises(MissingDependencyError) as err:
        Run({}, plugins={extra: Missing()})
    assert str(err.value) == (f"package 'not-here-client' is needed for plugins = [{extra!r}] (missing module "
                              f"'not_here_xyz'): {install}")
