"""engine-kubeflow against a small local fake of the Kubeflow Trainer controller's status endpoint (there is no
client library, and the controller runs only in a cluster): http.server in a thread records every request."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.testing import (assert_not_written, assert_tracker_failure_is_harmless, logged_scalars, raising_at,
                            run_and_resume, run_steps, tiny_dataset)

TOKEN = "eyJhbGciOiJSUzI1NiJ9.service-account-token-0123456789"
FAST = {"kubeflow": {"update_interval": 0}}  # every update sent, not one per 5 s


class FakeController:
    """Records ``(headers, trainerStatus)`` of each POST and answers 200; ``hang()``: answers nothing from then on."""

    def __init__(self):
        self.requests, self.hanging, self.released = [], False, threading.Event()
        controller = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if controller.hanging:
                    controller.released.wait()
                    return
                controller.requests.append((dict(self.headers), self.path, body["trainerStatus"]))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/api/trainjobs/default/job/status"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def hang(self):
        self.hanging = True

    def stop(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    def statuses(self):
        return [status for _, _, status in self.requests]


@pytest.fixture
def controller(tmp_path, monkeypatch):
    """A controller, and the variables a TrainJob's pod has (the token in a file, as Kubernetes mounts it)."""
    running = FakeController()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", running.url)
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_CA_CERT", raising=False)
    monkeypatch.setenv("ENGINE_REPORT", "off")  # the root conftest's setting, also when run from this folder
    yield running
    running.stop()


def metrics_of(status):
    return {item["name"]: float(item["value"]) for item in status.get("metrics", [])}


def assert_rows_received(statuses, reference):
    """Every number of metrics.jsonl reached the controller in an update of its step."""
    by_step = {}
    for status in statuses:
        metrics = metrics_of(status)
        if "current_step" in metrics:
            by_step.setdefault(int(metrics["current_step"]), []).append(metrics)
    for (name, step), value in reference.items():
        assert any(m.get(name) == value for m in by_step.get(step, [])), (name, step, value)


def test_progress_and_every_logged_number_reach_the_controller(controller, tmp_path, capfd):
    out = tmp_path / "out"
    run_steps(6, plugins=["kubeflow"], output_dir=out, sections=FAST, eval_dataset=tiny_dataset(8),
              train={"eval_strategy": "steps", "eval_steps": 3})
    first, *steps, last = controller.statuses()
    assert (first["progressPercentage"], metrics_of(first)) == (0, {"total_steps": 6})
    reference = logged_scalars(out)
    assert {"eval_loss", "loss", "train_runtime"} <= {name for name, _ in reference}
    summary = {key: value for key, value in reference.items() if key[0].startswith("train_")}
    assert_rows_received(steps, {key: value for key, value in reference.items() if key not in summary})
    for status in steps:
        step = int(metrics_of(status)["current_step"])
        assert status["progressPercentage"] == min(step * 100 // 6, 99)
        assert status["estimatedRemainingSeconds"] >= 0 and metrics_of(status)["total_steps"] == 6
    # the last update: done, and the newest value of every number logged
    newest = {}
    for (name, _), value in sorted(reference.items(), key=lambda item: item[0][1]):
        newest[name] = value
    assert (last["progressPercentage"], last["estimatedRemainingSeconds"], metrics_of(last)) == (100, 0, newest)
    headers = [headers for headers, _, _ in controller.requests]
    assert all(h["Authorization"] == f"Bearer {TOKEN}" and h["Content-Type"] == "application/json" for h in headers)
    assert {path for _, path, _ in controller.requests} == {"/api/trainjobs/default/job/status"}
    captured = capfd.readouterr()
    assert_not_written(TOKEN, [out], captured.out, captured.err)


def test_a_resumed_run_reports_its_progress_from_the_resumed_step(controller, tmp_path):
    reference = run_and_resume(["kubeflow"], tmp_path, sections=FAST)
    statuses = controller.statuses()
    (first_start, resumed_start) = [s for s in statuses if "current_step" not in metrics_of(s)
                                    and s["progressPercentage"] < 100]
    assert (first_start["progressPercentage"], resumed_start["progressPercentage"]) == (0, 50)
    resumed = statuses[statuses.index(resumed_start):]
    steps = [int(metrics_of(s)["current_step"]) for s in resumed if "current_step" in metrics_of(s)]
    assert steps == [3, 4, 4]  # the second 4: the summary's log
    assert_rows_received(resumed, {key: value for key, value in reference.items()
                                   if key[1] > 2 and not key[0].startswith("train_")})
    assert resumed[-1]["progressPercentage"] == 100


def test_a_controller_gone_mid_run_changes_nothing(controller, tmp_path):
    run = assert_tracker_failure_is_harmless("kubeflow", tmp_path, controller.stop, sections=FAST)
    assert run.state.global_step == 6
    record = json.loads((tmp_path / "tracked" / "run.json").read_text())
    assert f"kubeflow: {controller.url}: [Errno 111] Connection refused" in json.dumps(record["switched_off"])
    assert max(int(metrics_of(s).get("current_step", 0)) for s in controller.statuses()) <= 3


def test_a_controller_that_never_answers_neither_slows_nor_hangs_training(controller, tmp_path):
    sections = {"kubeflow": {"update_interval": 0, "request_timeout": 120, "connect_timeout": 1}}
    started = time.monotonic()
    assert_tracker_failure_is_harmless("kubeflow", tmp_path, controller.hang, sections=sections)
    # one hung request holds its thread for 120 s: the steps never waited for it, the end 1 s at most
    assert time.monotonic() - started < 60


def test_a_run_that_raised_reports_the_progress_it_reached_and_no_url_is_reported_once(controller, tmp_path,
                                                                                         monkeypatch):
    with pytest.raises(RuntimeError, match="boom"):
        run_steps(4, plugins=["kubeflow"], objects=[raising_at(2)], output_dir=tmp_path / "raised", sections=FAST)
    last = controller.statuses()[-1]
    assert last["progressPercentage"] == 50 and "estimatedRemainingSeconds" not in last
    assert metrics_of(last) == {name: value for (name, _), value in logged_scalars(tmp_path / "raised").items()}

    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL")
    run = run_steps(1, plugins=["kubeflow"], output_dir=tmp_path / "no-url")
    record = json.loads((tmp_path / "no-url" / "run.json").read_text())
    assert list(record["switched_off"]) == ["kubeflow"] and "KUBEFLOW_TRAINER_SERVER_URL" in \
        json.dumps(record["switched_off"]), record
    assert run.state.global_step == 1
