"""Progress reported to the Kubeflow Trainer controller (``plugins = ["kubeflow"]``, Trainer's ``report_to``).

Inside a Kubeflow TrainJob whose runtime has the ``TrainJobRuntimeStatus`` feature, the controller
injects ``KUBEFLOW_TRAINER_SERVER_URL`` (an HTTPS endpoint), ``KUBEFLOW_TRAINER_SERVER_TOKEN`` (the
path of a service-account token) and ``KUBEFLOW_TRAINER_SERVER_CA_CERT`` (the path of its CA
certificate), and shows what it receives in the TrainJob's status. As Trainer's KubeflowCallback,
the plugin POSTs ``{"trainerStatus": {"lastUpdatedTime", "progressPercentage",
"estimatedRemainingSeconds", "metrics": [{"name", "value"}]}}`` with ``Authorization: Bearer <token>``:

* when training starts: the progress of the step it starts from (0, or the resumed step's), and
  ``total_steps``;
* after steps and logs, at most one update per ``update_interval`` seconds: the progress (capped
  at 99 until the end), the time left (from this process's pace since it started: a resumed run
  counts from its resume), and the newest value of every number logged so far, with
  ``current_step``, ``total_steps`` and ``current_epoch``;
* at the end: 100 % and 0 s left when training succeeded, else the progress it reached.

There is no client library: the requests are urllib's, sent one by one from a
:class:`~engine.tracking.BackgroundSender` thread with ``request_timeout`` each, so steps never
wait on the controller. A request that fails (controller gone, 401/403, timeout) is reported once
by name and the plugin switched off, training goes on (``strict = true``: the run ends); the end of
the run waits ``connect_timeout`` at most for the last update. The token file is read by that
thread for each request (kubelet rotates it) and never logged or written. Only the main process
reports. The TrainJob is the run: there is no run id to keep, and a resumed run reports into the
same TrainJob from its step on. Kubeflow shows no config, samples or run status (the TrainJob's
own status says whether it failed).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from engine import hookimpl, option
from engine.tracking import BackgroundSender, Tracker, scalar_metrics

# what the controller injects into the training pod (Trainer's KubeflowCallback reads the same)
URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"


@dataclass
class KubeflowOptions:
    server_url: str | None = option(None, help=f"the controller's status endpoint; default ${URL_ENV}")
    token_file: str | None = option(None, help=f"the service-account token's file; default ${TOKEN_ENV}")
    ca_file: str | None = option(None, help=(
        f"the CA certificate the endpoint's TLS certificate is checked with; default ${CA_ENV}, else the system's"))
    update_interval: float = option(5.0, min=0, help=(
        "seconds between two progress updates at least (Trainer's: 5); the first and the last are always sent"))
    request_timeout: float = option(5.0, min=0.1, help="seconds one request may take (Trainer's: 5)")
    connect_timeout: float = option(10.0, min=1, help=(
        "seconds the end of the run waits for the last update; a controller that does not answer switches the "
        "plugin off (strict = true: ends the run)"))
    strict: bool = option(False, help="a failed update ends the run (default: reported, then switched off)")


def progress_percent(step: int, max_steps: int) -> int:
    """The progress of ``step`` of ``max_steps``, 99 at most: 100 is the end of training's alone."""
    return min(int(step / max_steps * 100), 99) if max_steps > 0 else 0


class Controller:
    """Sends trainer status updates to the controller's endpoint (from the sender's thread)."""

    def __init__(self, url: str, token_file: str, ca_file: str | None, timeout: float):
        import ssl

        self.url, self.token_file, self.timeout = url, token_file, timeout
        self.ssl_context = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def post(self, status: dict[str, Any]) -> None:
        import urllib.error
        import urllib.request

        with open(self.token_file, encoding="utf-8") as file:
            token = file.read().strip()
        request = urllib.request.Request(
            self.url, data=json.dumps({"trainerStatus": status}).encode(), method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.ssl_context):
                pass  # an error status raises HTTPError
        except urllib.error.HTTPError as exc:  # 401, 403, 404...: the status says why
            raise ConnectionError(f"kubeflow: {self.url}: {exc}") from None
        except OSError as exc:  # URLError (refused, unknown host, TLS), a timeout
            raise ConnectionError(f"kubeflow: {self.url}: {getattr(exc, 'reason', exc)}") from None


class KubeflowTracker(Tracker):
    # no client library: the standard library's urllib sends the requests
    extra, package, options = "kubeflow", "urllib.request", KubeflowOptions

    def __init__(self):
        super().__init__()
        self.sender: BackgroundSender | None = None
        self.controller: Controller | None = None
        self.metrics: dict[str, float] = {}  # the newest value of every number logged
        self.start_step = 0
        self.start_time = 0.0
        self.last_sent = 0.0
        self.failure: Exception | None = None  # a submit that failed in on_step_end, raised by the next log hook

    @hookimpl
    def log_hyperparams(self, run, params):
        options = run.config.section("kubeflow")
        url = options.server_url or os.environ.get(URL_ENV)
        token_file = options.token_file or os.environ.get(TOKEN_ENV)
        if not url:
            raise RuntimeError(f"kubeflow: no controller to report to: set kubeflow.server_url or {URL_ENV} "
                               "(a TrainJob with TrainJobRuntimeStatus sets it)")
        if not token_file or not os.path.isfile(token_file):
            raise RuntimeError(f"kubeflow: no service-account token file ({token_file or 'unset'}): set "
                               f"kubeflow.token_file or {TOKEN_ENV}")
        self.controller = Controller(url, token_file, options.ca_file or os.environ.get(CA_ENV),
                                     options.request_timeout)
        self.sender = BackgroundSender("kubeflow")
        self.start_step, self.start_time = run.state.global_step, time.monotonic()
        self._send({"progressPercentage": progress_percent(self.start_step, run.state.max_steps),
                    "metrics": {"total_steps": run.state.max_steps}})

    @hookimpl
    def on_step_end(self, run):
        # not an isolated hook: the update waits for this step's logs when it has some, and an error
        # is kept for the next logging hook to raise (where the engine reports it and switches off)
        sending = self.sender is not None and self.sender.error is None and self.failure is None
        if sending and not run.control.should_log and self._due(run):
            try:
                self._progress(run)
            except Exception as exc:
                self.failure = exc

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.sender is None:
            return
        if self.failure is not None:
            raise self.failure
        self.metrics.update(scalar_metrics(metrics))
        if self._due(run):
            self._progress(run)

    @hookimpl
    def log_finish(self, run, status):
        if self.sender is None:
            return
        state = run.state
        final = {"metrics": self.metrics}
        if status == "success":
            final.update(progressPercentage=100, estimatedRemainingSeconds=0)
        else:
            final["progressPercentage"] = progress_percent(state.global_step, state.max_steps)
        try:
            self._send(final)
        finally:
            sender, self.sender = self.sender, None
            sender.close(timeout=run.config.section("kubeflow").connect_timeout)

    def _due(self, run) -> bool:
        return time.monotonic() - self.last_sent >= run.config.section("kubeflow").update_interval

    def _progress(self, run):
        state = run.state
        done, left = state.global_step - self.start_step, state.max_steps - state.global_step
        metrics = {**self.metrics, "current_step": state.global_step, "total_steps": state.max_steps}
        if state.epoch is not None:
            metrics["current_epoch"] = round(state.epoch, 2)
        update = {"progressPercentage": progress_percent(state.global_step, state.max_steps), "metrics": metrics}
        if done > 0 and state.max_steps > 0:
            update["estimatedRemainingSeconds"] = max(0, int((time.monotonic() - self.start_time) / done * left))
        self._send(update)

    def _send(self, update: dict[str, Any]) -> None:
        self.last_sent = time.monotonic()
        controller, status = self.controller, self._status(update)
        self.sender.submit(lambda: controller.post(status))

    @staticmethod
    def _status(update: dict[str, Any]) -> dict[str, Any]:
        """The controller's trainerStatus: metric values as strings, as Trainer sends them."""
        status = {"lastUpdatedTime": datetime.now(timezone.utc).isoformat(), **update}
        if "metrics" in status:
            status["metrics"] = [{"name": str(name), "value": str(value)} for name, value in status["metrics"].items()]
        return status
