"""engine-azureml with the real azureml-core outside a job: ``Run.get_context()`` is its offline run, which
keeps nothing and prints each call on stdout; those lines are what is read back. The job's run needs Azure
(a workspace, the job's token and run-history service): the calls it gets are checked on a stand-in with
Run's own signatures, injected as ``Run.get_context()``."""

import ast
import inspect
import json
import re

import pytest
from azureml.core.run import Run, _OfflineRun

from engine.testing import assert_not_written, assert_tracker_failure_is_harmless, raising_at, run_and_resume, run_steps
from engine.tracking import flatten_config

SECRET = "azureml-run-token-never-written"


def printed(out):
    """What the offline run printed: ([(metric, value)] in order, [tags], [table metrics], [failures])."""
    metrics = [(name, float(value)) for name, value in re.findall(r"^Attempted to log scalar metric (.+):\n(.+)$",
                                                                   out, re.M)]
    tags = [ast.literal_eval(text) for text in re.findall(r"^Attempted to set tags (\{.*\})$", out, re.M)]
    tables = [ast.literal_eval(text) for text in re.findall(r"^Attempted to log table metric samples:\n(.+)$", out,
                                                            re.M)]
    return metrics, tags, tables, re.findall(r"^Run failed with error code None:\n(.+)$", out, re.M)


def logged_in_order(output_dir):
    """metrics.jsonl's numbers as [(name, value)], row after row: the offline run's log has no step."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [(name, float(value)) for row in rows for name, value in row.items()
            if name != "step" and isinstance(value, (int, float))]


def test_offline_run_gets_the_config_every_metric_and_the_samples_and_no_token(tmp_path, capfd, monkeypatch):
    from engine.testing import tiny_model, tiny_tokenizer

    monkeypatch.setenv("AZUREML_RUN_TOKEN", SECRET)  # a job's token alone is no job: still offline
    sections = {"azureml": {"tags": {"team": "nlp"}},
                "samples": {"prompts": ["the quick", "fox"], "every": "end", "max_new_tokens": 3}}
    run_steps(3, plugins=["azureml", "samples"], output_dir=tmp_path, model=tiny_model(vocab_size=300),
              tokenizer=tiny_tokenizer(), sections=sections)
    out, err = capfd.readouterr()
    metrics, tags, tables, failures = printed(out)
    assert metrics == logged_in_order(tmp_path) and ("loss", metrics[0][1]) == metrics[0]
    hyperparams = json.loads((tmp_path / "hyperparams.json").read_text())
    assert tags == [{**{key: str(value) for key, value in flatten_config(hyperparams).items()}, "team": "nlp"}]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert tables == [{"step": [3, 3], "prompt": [row["prompt"] for row in rows],
                       "completion": [row["completion"] for row in rows]}]
    assert failures == []  # complete() of an offline run prints nothing
    assert "engine: azureml: not inside an Azure ML job" in err
    assert_not_written(SECRET, [tmp_path], out, err)


def test_a_resume_is_a_new_run_tagged_with_the_run_it_continues(tmp_path, capfd):
    reference = run_and_resume(["azureml"], tmp_path)
    metrics, tags, _, _ = printed(capfd.readouterr().out)
    assert metrics == logged_in_order(tmp_path) and len(metrics) == len(reference)
    first, resumed = tags
    assert "engine.resumed_from" not in first and resumed["engine.resumed_from"].startswith("OfflineRun_")


def test_a_failing_client_is_harmless(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ConnectionError("run history is gone")

    assert_tracker_failure_is_harmless("azureml", tmp_path, lambda: monkeypatch.setattr(_OfflineRun, "log", refuse))


def test_a_run_that_raised_calls_fail(tmp_path, capfd):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(4, plugins=["azureml"], objects=[raising_at(2)], output_dir=tmp_path)
    *_, failures = printed(capfd.readouterr().out)
    assert failures == ["training raised (see the job's log)"]


class JobRun:
    """Stands in for the job's run (``_SubmittedRun``) with Run's signatures: records the calls."""

    id = "job-run-2"

    def __init__(self):
        self.calls = []

    def log(self, name, value, description="", step=None):
        self.calls.append(("log", name, value, step))

    def log_table(self, name, value, description=""):
        self.calls.append(("log_table", name))

    def set_tags(self, tags):
        self.calls.append(("set_tags", tags))

    def complete(self):
        self.calls.append(("complete",))

    def fail(self, error_details=None, error_code=None):
        self.calls.append(("fail", error_details))


def test_inside_a_job_metrics_go_at_their_step_and_the_run_is_completed_or_failed(tmp_path, monkeypatch):
    for method in ("log", "log_table", "set_tags", "complete", "fail"):  # the SDK's own signatures
        theirs = [p for p in inspect.signature(getattr(Run, method)).parameters if not p.startswith("_")]
        assert [p for p in inspect.signature(getattr(JobRun, method)).parameters] == theirs, method
    job = JobRun()
    monkeypatch.setattr(Run, "get_context", classmethod(lambda cls, **kwargs: job))
    run_steps(3, plugins=["azureml"], output_dir=tmp_path / "ok")
    rows = [json.loads(line) for line in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    logged = [("log", name, float(value), row["step"]) for row in rows for name, value in row.items()
              if name != "step" and isinstance(value, (int, float))]
    assert job.calls[0][0] == "set_tags" and job.calls[1:] == [*logged, ("complete",)]

    job.calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(4, plugins=["azureml"], objects=[raising_at(2)], output_dir=tmp_path / "raised")
    assert job.calls[-1] == ("fail", "training raised (see the job's log)")
