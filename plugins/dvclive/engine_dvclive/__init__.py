"""DVCLive tracking for the engine (``plugins = ["dvclive"]``, Trainer's ``report_to``).

A ``dvclive.Live`` writes the run into plain files under ``dir`` (default ``output_dir/dvclive``):
the composed config as ``params.yaml`` (nested, as given), each metric as
``plots/metrics/<name>.tsv`` rows at the engine's optimizer step (Live's own step counter is
set to it before each row), the latest values in ``metrics.json``, and a ``dvc.yaml`` that
points DVC at them (``dvc plots show``, ``dvc exp show``, DVC Studio, the VS Code extension).
At the end ``Live.end()`` writes the last summary and, in a Git repository with a commit,
saves a DVC experiment (``save_dvc_exp``). Nothing needs a network: Studio is posted to only
when a Studio token is configured (``DVC_STUDIO_TOKEN``, DVC's own business).

Live's calls write files (and ``dvc.yaml`` through a YAML round trip, ~15 ms per row), its
start imports DVC (~2 s) and its end may run ``dvc exp save`` or post to Studio, so all of it
runs on a thread of this plugin (:class:`BackgroundSender`): steps never wait, and the end of
the run waits ``end_timeout`` seconds at most.

Resume: the run's DVC experiment name is kept in checkpoints; a resumed run opens the same
folder with ``Live(resume=True)`` (rows after the checkpoint's step, from the interrupted run,
are dropped first, as ``metrics.jsonl`` drops them), so one set of files holds every step.

Not supported: DVCLive has no text or table logging (only metrics, images, plots and
artifacts), so ``log_samples`` has nothing to show and samples stay in ``samples.jsonl``;
there is no run status either (a failed run ends like a finished one: ``Live.end()``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine import hookimpl, option
from engine.tracking import BackgroundSender, Tracker, scalar_metrics

logger = logging.getLogger("engine")

TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # transformers' ENV_VARS_TRUE_VALUES


@dataclass
class DVCLiveOptions:
    dir: str | None = option(None, help="DVCLive's folder (Live's dir); default <output_dir>/dvclive")
    dvcyaml: str | bool = option(True, help=(
        "the dvc.yaml DVCLive keeps pointing at its metrics, plots and params: a path (named dvc.yaml); true: "
        "dvc.yaml beside dir (output_dir/dvc.yaml by default); false: none"))
    save_dvc_exp: bool = option(True, help=(
        "save a DVC experiment at the end (needs a Git repository with a commit; else DVCLive warns and skips it)"))
    exp_name: str | None = option(None, help="the DVC experiment's name; default DVC_EXP_NAME, else a random one")
    exp_message: str | None = option(None, help="the DVC experiment's message (dvc exp save --message)")
    report: Literal["html", "md"] | None = option(None, help=(
        "a report DVCLive writes in dir at each log: 'html', or 'md' (needs matplotlib)"))
    log_model: bool | Literal["all"] | None = option(None, help=(
        "track models with DVC (needs a DVC repository): true: the final model at the end (as <dir>/artifacts/last, "
        "or best with load_best_model_at_end); 'all': every checkpoint as it is saved; default HF_DVCLIVE_LOG_MODEL"))
    sync_interval: float = option(1.0, min=0, help=(
        "seconds between DVCLive's syncs (metrics.json, dvc.yaml, the report, Studio's live updates; ~15 ms each): "
        "every row still goes into the .tsv files at once (0: a sync per log, as Trainer's callback)"))
    end_timeout: float = option(60.0, min=1, help=(
        "seconds the end of the run waits for DVCLive to write what is queued and end (dvc exp save, Studio); "
        "what is still running then is left behind and reported"))
    strict: bool = option(False, help="a tracking failure ends the run (default: reported, then switched off)")


def log_model_setting(options: DVCLiveOptions) -> bool | str:
    """``log_model`` of the run file, else Trainer's HF_DVCLIVE_LOG_MODEL (true/1/yes/on, or all)."""
    if options.log_model is not None:
        return options.log_model
    value = os.environ.get("HF_DVCLIVE_LOG_MODEL", "false")
    return "all" if value.lower() == "all" else value.upper() in TRUE_VALUES


def drop_rows_after(plots_dir: Path, step: int) -> None:
    """Drop the rows of steps after ``step`` from every metric's ``.tsv`` (an interrupted run logged
    them after the checkpoint a resume starts from; the resumed run logs those steps again)."""
    for path in (plots_dir / "metrics").rglob("*.tsv"):
        header, *rows = path.read_text(encoding="utf-8").splitlines()
        column = header.split("\t").index("step")
        kept = [row for row in rows if int(row.split("\t")[column]) <= step]
        path.write_text("\n".join([header, *kept]) + "\n", encoding="utf-8")


class DVCLiveTracker(Tracker):
    extra, package, options = "dvclive", "dvclive", DVCLiveOptions

    def __init__(self):
        super().__init__()
        self.live = None
        self.sender: BackgroundSender | None = None
        self.last_sync = 0.0  # when DVCLive last synced its summary files
        self.last_step: int | None = None  # of the last row logged

    @hookimpl
    def log_hyperparams(self, run, params):
        options = run.config.section("dvclive")
        folder = Path(options.dir) if options.dir else run.output_dir / "dvclive"
        dvcyaml = str(folder.parent / "dvc.yaml") if options.dvcyaml is True else options.dvcyaml
        resumed_at = run.state.global_step  # > 0: restored from a checkpoint
        exp_name = options.exp_name or self.run_id
        self.sender = BackgroundSender("dvclive")
        self.sender.submit(lambda: self._start(folder, dvcyaml, options, exp_name, resumed_at, params))

    def _start(self, folder: Path, dvcyaml: Any, options: DVCLiveOptions, exp_name: str | None, resumed_at: int,
               params: dict[str, Any]) -> None:
        from dvclive import Live

        if resumed_at:
            drop_rows_after(folder / "plots", resumed_at)
        self.live = Live(dir=str(folder), resume=bool(resumed_at), report=options.report,
                         save_dvc_exp=options.save_dvc_exp, dvcyaml=dvcyaml, exp_name=exp_name,
                         exp_message=options.exp_message)
        self.run_id = self.live._exp_name  # the name DVCLive chose (no public accessor): a resume keeps it
        self.live.log_params(params)

    def _log(self, row: dict[str, float], step: int, sync_interval: float) -> None:
        self.live.step = self.last_step = step  # Live counts its own steps; each row goes at the engine's
        for name, value in row.items():
            self.live.log_metric(name, value)
        now = time.monotonic()
        if now - self.last_sync >= sync_interval:  # Live.end() syncs the last rows
            self.live.next_step()  # writes metrics.json and dvc.yaml (and the report), posts to Studio
            self.last_sync = now

    @hookimpl
    def log_metrics(self, run, metrics, step):
        if self.sender is not None:  # None: evaluate() outside training
            row, interval = scalar_metrics(metrics), run.config.section("dvclive").sync_interval
            self.sender.submit(lambda: self._log(row, step, interval))

    @hookimpl
    def on_checkpoint_saved(self, run, path):
        if self.sender is not None and log_model_setting(run.config.section("dvclive")) == "all":
            self.sender.submit(lambda: self.live.log_artifact(path))

    def _log_final_model(self, run) -> None:
        from engine.kit.checkpoint import final_model_files

        files = final_model_files(run.output_dir)
        if files:
            name = "best" if run.config.train.load_best_model_at_end else "last"
            folder = Path(self.live.artifacts_dir) / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            for file in files:
                shutil.copy2(run.output_dir / file, folder / file)
            self.live.log_artifact(str(folder), name=name, type="model")

    def _end(self, run, status: str) -> None:
        if status == "success" and log_model_setting(run.config.section("dvclive")) is True:
            self._log_final_model(run)
        if self.last_step is not None:  # end() goes back to the step of the last summary: make it the last row's
            self.live.step = self.last_step
            self.live.make_summary()
        self.live.end()

    @hookimpl
    def log_finish(self, run, status):
        if self.sender is not None:
            sender, self.sender = self.sender, None
            sender.submit(lambda: self._end(run, status))
            sender.close(timeout=run.config.section("dvclive").end_timeout)
