"""SwanLab tracking for the engine (``plugins = ["swanlab"]``, Trainer's ``report_to``).

One training run is one SwanLab experiment (``swanlab.init``) in a project of a workspace: the
composed config is its config (nested, as SwanLab shows it), every number of a log a scalar at its
optimizer step, generated samples (``log_samples``) a ``swanlab.Text`` list ``samples`` at theirs
(the completion, captioned with its prompt), and the experiment finishes ``success``, or
``crashed`` when training raised. SwanLab's own thread writes and uploads, so steps never wait on
the network (a service that is away keeps the records in memory); finishing waits for the upload
30 s at most (SwanLab's own bound). The service is first asked whether it answers, for
``connect_timeout`` seconds at most: SwanLab's login retries a host that does not.

``mode = "offline"`` (or ``SWANLAB_MODE=offline``) needs no account: the experiment is written under
``log_dir`` (default ``output_dir/swanlog``) and ``swanlab sync`` uploads it later. The experiment
id is kept in checkpoints: a resumed training run continues the same experiment
(``resume="allow"``); offline, each process writes a folder of its own holding that id, which
``swanlab sync`` joins into the one experiment. The API key is SwanLab's business
(``SWANLAB_API_KEY``, ``swanlab login``): this plugin never reads, logs or stores it, and never lets
SwanLab ask for one on the terminal (no key online: reported, and the plugin switched off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from engine import hookimpl, option
from engine.tracking import Tracker, sample_rows, scalar_metrics, tracker_run_name, wait_for_server


@dataclass
class SwanLabOptions:
    project: str | None = option(None, help=(
        "SwanLab project; default SWANLAB_PROJECT, else SWANLAB_PROJ_NAME, else the working directory's name"))
    workspace: str | None = option(None, help="workspace (organization); default SWANLAB_WORKSPACE, else your user")
    name: str | None = option(None, help="the experiment's name; default train.run_name or output_dir's name")
    description: str | None = option(None, help="the experiment's description")
    tags: list[str] = option(help="tags of the experiment", default_factory=list)
    group: str | None = option(None, help="group experiments together (e.g. the runs of one sweep)")
    mode: Literal["online", "local", "offline", "disabled"] | None = option(None, help=(
        "online: to the SwanLab service; offline: files in log_dir for `swanlab sync`; default SWANLAB_MODE, "
        "else online"))
    log_dir: str | None = option(None, help="where the run's files go; default SWANLAB_LOG_DIR, else output_dir/swanlog")
    connect_timeout: float = option(30.0, min=1, help=(
        "online: seconds the SwanLab service has to answer when the run starts; one that does not switches the "
        "tracker off (strict = true: ends the run)"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


class SwanLabTracker(Tracker):
    extra, package, options = 'swanlab', 'swanlab', SwanLabOptions

    def __init__(self):
        super().__init__()  # run_id: the SwanLab experiment's id
        self.swanlab_run = None

    @hookimpl
    def log_hyperparams(self, run, params):
        import swanlab

        options = run.config.section("swanlab")
        settings = swanlab.Settings(interactive=False)  # never a login prompt that waits for the terminal
        if (options.mode or settings.mode) == "online":  # its login retries a host that does not answer
            wait_for_server(settings.api_host, options.connect_timeout, "swanlab")
        self.swanlab_run = swanlab.init(
            project=options.project or os.environ.get("SWANLAB_PROJECT"), workspace=options.workspace,
            name=options.name or tracker_run_name(run), description=options.description, tags=options.tags or None,
            group=options.group, mode=options.mode, config=params, settings=settings,
            log_dir=options.log_dir or os.environ.get("SWANLAB_LOG_DIR") or str(run.output_dir / "swanlog"),
            id=self.run_id, resume="allow" if self.run_id else None)
        self.run_id = self.swanlab_run.id

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.swanlab_run is not None:  # None: evaluate() outside training
            self.swanlab_run.log(scalar_metrics(metrics), step=step)

    @hookimpl
    def log_samples(self, run, samples, step):
        if self.swanlab_run is not None:
            import swanlab

            texts = [swanlab.Text(completion, caption=prompt) for _, prompt, completion in sample_rows(samples)]
            self.swanlab_run.log({"samples": texts}, step=step)

    @hookimpl
    def log_finish(self, run, status):
        if self.swanlab_run is not None:
            swanlab_run, self.swanlab_run = self.swanlab_run, None
            # on this thread, init's: finish puts back the SIGINT handler init replaced (and
            # waits for the upload SwanLab's own 30 s at most)
            if status == "success":
                swanlab_run.finish("success")
            else:
                swanlab_run.finish("crashed", error="training raised")
