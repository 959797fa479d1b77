"""Neptune tracking for the engine (``plugins = ["neptune"]``, Trainer's ``report_to = ["neptune"]``).

One training run is one Neptune run (``neptune.init_run``), its fields under ``base_namespace``
(default ``finetuning``, as Trainer's NeptuneCallback): the composed config once as
``<base>/config/...`` (flattened as :func:`engine.tracking.flatten_config` does: lists as JSON
text, None as "None"), every number of a log as a float series ``<base>/<name>`` at its optimizer
step, generated samples (``log_samples``) as a CSV file ``<base>/samples/step_<step>``. A run that
raised sets ``sys/failed``, Neptune's own failed state. Calls go through a thread of this plugin
(Neptune's ``sync`` mode sends each before it returns; ``async`` queues on disk for its own
sender), and the start waits ``connect_timeout`` at most for ``init_run``.

Neptune keeps its queue in ``NEPTUNE_DATA_DIRECTORY`` (else ``.neptune`` in the working
folder); this plugin puts it in ``data_directory``, default ``output_dir/.neptune``. Offline
(``mode = "offline"``) the run stays there, and ``neptune sync --path <output_dir>`` uploads it
later; :mod:`engine_neptune.offline` reads it back.

Resume: the run is created with a ``custom_run_id`` (``NEPTUNE_CUSTOM_RUN_ID``, else a new one)
kept in checkpoints, so a resumed training run in ``async``/``sync`` mode continues the same
Neptune run. Offline runs do not record it: a resumed offline training run is a second offline
run, and ``neptune sync`` uploads two runs. The API token is Neptune's business
(``NEPTUNE_API_TOKEN``): this plugin never reads, logs or stores it.
"""

from __future__ import annotations

import csv
import io
import os
import uuid
from dataclasses import dataclass
from typing import Literal

from engine import hookimpl, option
from engine.tracking import (SAMPLE_COLUMNS, BackgroundSender, Tracker, call_with_timeout, first_line, flatten_config,
                             sample_rows, scalar_metrics, tracker_run_name)


@dataclass
class NeptuneOptions:
    project: str | None = option(None, help="'workspace/project'; default NEPTUNE_PROJECT")
    name: str | None = option(None, help="the Neptune run's name; default train.run_name or output_dir's name")
    tags: list[str] = option(help="tags of the run", default_factory=list)
    mode: Literal["async", "sync", "offline", "debug"] | None = option(None, help=(
        "Neptune's connection mode; default NEPTUNE_MODE, else async (offline: kept on disk for neptune sync)"))
    base_namespace: str = option("finetuning", nonempty=True, help="namespace of the run's config, metrics and samples")
    data_directory: str | None = option(None, help=(
        "Neptune's queue and offline runs; default NEPTUNE_DATA_DIRECTORY, else output_dir/.neptune"))
    connect_timeout: float = option(30.0, min=1, help=(
        "seconds init_run may take, and the end of the run waits for Neptune to send what is queued; a start that "
        "takes longer switches the tracker off (strict = true: ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class NeptuneTracker(Tracker):
    extra, package, options = 'neptune', 'neptune', NeptuneOptions

    def __init__(self):
        super().__init__()
        self.neptune_run = None
        self.sender: BackgroundSender | None = None

    @hookimpl
    def log_hyperparams(self, run, params):
        from neptune.attributes.atoms.string import String

        options = run.config.section("neptune")
        self.run_id = self.run_id or os.environ.get("NEPTUNE_CUSTOM_RUN_ID") or uuid.uuid4().hex
        try:  # init_run retries a server that does not answer
            call_with_timeout(lambda: self._start(run, options), options.connect_timeout, "neptune: init_run")
        except TimeoutError as exc:
            raise ConnectionError(f"{exc} (neptune.connect_timeout)") from None
        flat = flatten_config(params, max_value_length=String.MAX_VALUE_LENGTH, tracker="neptune")
        config = {key.replace(".", "/"): value for key, value in flat.items()}  # "/": Neptune's namespaces
        field = self.neptune_run[f"{options.base_namespace}/config"]
        self.sender = BackgroundSender("neptune")
        self.sender.submit(lambda: field.assign(config))

    def _start(self, run, options):
        import neptune
        from neptune.exceptions import NeptuneException

        # Neptune reads its folder from the environment when the run is created, and nowhere else
        previous = os.environ.get("NEPTUNE_DATA_DIRECTORY")
        os.environ["NEPTUNE_DATA_DIRECTORY"] = options.data_directory or previous or str(run.output_dir / ".neptune")
        try:
            self.neptune_run = neptune.init_run(
                project=options.project, name=options.name or tracker_run_name(run), tags=options.tags or None,
                mode=options.mode, custom_run_id=self.run_id)
        except NeptuneException as exc:  # its message is a coloured banner of many lines
            raise RuntimeError(f"neptune: {type(exc).__name__}: {first_line(exc)}") from None
        finally:
            if previous is None:
                del os.environ["NEPTUNE_DATA_DIRECTORY"]
            else:
                os.environ["NEPTUNE_DATA_DIRECTORY"] = previous

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.sender is not None:  # None: evaluate() outside training
            namespace = self.neptune_run[run.config.section("neptune").base_namespace]
            row = scalar_metrics(metrics)
            self.sender.submit(lambda: [namespace[name].append(value, step=step) for name, value in row.items()])

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.sender is not None:
            from neptune.types import File

            text = io.StringIO()
            csv.writer(text).writerows([SAMPLE_COLUMNS, *sample_rows(samples)])
            field = self.neptune_run[f"{run.config.section('neptune').base_namespace}/samples/step_{step}"]
            self.sender.submit(lambda: field.upload(File.from_content(text.getvalue(), extension="csv")))

    @hookimpl
    def log_finish(self, run, status):
        if self.neptune_run is None:
            return
        neptune_run, self.neptune_run = self.neptune_run, None
        sender, self.sender = self.sender, None
        timeout = run.config.section("neptune").connect_timeout
        try:
            if sender is not None:
                sender.close(timeout=timeout)  # what is queued is logged first (an error it met is raised after)
        finally:
            if status != "success":
                neptune_run["sys/failed"] = True
            neptune_run.stop(seconds=timeout)  # waits for Neptune's own sender that long at most
