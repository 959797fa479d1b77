"""DagsHub tracking for the engine (``plugins = ["dagshub"]``, Trainer's ``report_to="dagshub"``).

A DagsHub repository hosts an MLflow tracking server at ``https://dagshub.com/<owner>/<repo>.mlflow``,
so this plugin is engine-mlflow's :class:`~engine_mlflow.MLflowTracker` pointed there: the config as
params once, metrics at their step (sent in batches from a thread), samples as a table artifact, the
run FINISHED or FAILED, the MLflow run id kept in checkpoints so a resumed training continues the
same run; a server that does not answer is reported once and the plugin switched off. Its options
are MLflow's plus the repository, in a section ``[dagshub]`` of their own (``tracking_uri``, when
given, replaces the repository's server: a self-hosted MLflow, or a local one in tests).

At the end of a successful run the final model can also be committed to the repository itself
(``upload_to_repo``; Trainer's ``HF_DAGSHUB_LOG_ARTIFACTS``), under ``repo_path`` on ``branch``, with
DagsHub's client (``dagshub.upload.Repo``), from a thread, waited for ``upload_timeout`` at most.

There is no offline mode: DagsHub is a service (runs go to a local MLflow store with the mlflow
plugin instead). Credentials are the clients' own: MLflow reads ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD`` (what ``dagshub.init()`` sets), the upload uses ``DAGSHUB_USER_TOKEN``
or the token ``dagshub login`` cached; this plugin never reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass

from engine import ConfigError, hookimpl, option
from engine.tracking import call_with_timeout
from engine_mlflow import MLflowOptions, MLflowTracker

logger = logging.getLogger("engine")

TRUE_VALUES = {"1", "true", "yes", "on"}  # transformers' ENV_VARS_TRUE_VALUES
DAGSHUB_MLFLOW_URI = re.compile(r"/(?P<owner>[^/]+)/(?P<name>[^/]+)\.mlflow/?$")


@dataclass
class DagsHubOptions(MLflowOptions):
    repo_owner: str | None = option(None, help=(
        "user or organisation owning the DagsHub repository; default: read from MLFLOW_TRACKING_URI "
        "(https://dagshub.com/<owner>/<repo>.mlflow, as Trainer does)"))
    repo_name: str | None = option(None, help="the DagsHub repository; default: read from MLFLOW_TRACKING_URI")
    tracking_uri: str | None = option(None, help=(
        "MLflow tracking server; default: the repository's, <DagsHub host>/<owner>/<repo>.mlflow (the host is "
        "DAGSHUB_CLIENT_HOST, else https://dagshub.com)"))
    upload_to_repo: bool | None = option(None, help=(
        "commit the final model to the repository at the end of a successful run; default HF_DAGSHUB_LOG_ARTIFACTS"))
    repo_path: str = option("artifacts", nonempty=True, help="folder of the repository the final model goes to")
    branch: str | None = option(None, help="branch the final model is committed to; default BRANCH, else the "
                                           "repository's default branch")
    upload_timeout: float = option(600.0, min=1, help=(
        "seconds the end of the run waits for the commit to the repository at most (the rest is dropped, reported)"))


def repository(options: DagsHubOptions) -> tuple[str, str] | None:
    """(owner, name) of the repository: the options, else MLFLOW_TRACKING_URI's DagsHub address."""
    if options.repo_owner and options.repo_name:
        return options.repo_owner, options.repo_name
    found = DAGSHUB_MLFLOW_URI.search(os.environ.get("MLFLOW_TRACKING_URI", ""))
    return (found["owner"], found["name"]) if found else None


def commits_model(options: DagsHubOptions) -> bool:
    if options.upload_to_repo is not None:
        return options.upload_to_repo
    return os.environ.get("HF_DAGSHUB_LOG_ARTIFACTS", "").lower() in TRUE_VALUES


class DagsHubTracker(MLflowTracker):
    extra, package, distribution, options = "dagshub", "dagshub", "dagshub", DagsHubOptions

    def __init__(self):
        super().__init__()
        self._mlflow_options: MLflowOptions | None = None  # derived once from [dagshub]

    @hookimpl
    def configure(self, run):
        super().configure(run)
        options = run.config.section("dagshub")
        if repository(options) is None and (options.tracking_uri is None or commits_model(options)):
            raise ConfigError("dagshub: set dagshub.repo_owner and dagshub.repo_name (or MLFLOW_TRACKING_URI to "
                              "https://dagshub.com/<owner>/<repo>.mlflow)")

    def mlflow_options(self, run) -> MLflowOptions:
        """MLflow's options from ``[dagshub]``, the tracking URI the repository's unless one is given."""
        if self._mlflow_options is None:
            from dagshub.common import config

            options = run.config.section("dagshub")
            fields = {field.name: getattr(options, field.name) for field in dataclasses.fields(MLflowOptions)}
            if not options.tracking_uri:
                owner, name = repository(options)
                fields["tracking_uri"] = f"{config.host}/{owner}/{name}.mlflow"
            self._mlflow_options = MLflowOptions(**fields)
        return self._mlflow_options

    @hookimpl
    def log_finish(self, run, status):
        started = self.sender is not None  # None: the MLflow run never started (or evaluate() after training)
        super().log_finish(run, status)
        options = run.config.section("dagshub")
        if started and status == "success" and commits_model(options):
            commit_final_model(run.output_dir, options)


def commit_final_model(output_dir, options: DagsHubOptions) -> None:
    """Commit the final model's files to ``repo_path`` of the repository, from a thread, waiting
    ``upload_timeout`` at most (the client's upload request itself has no timeout)."""
    import dagshub.auth
    from dagshub.common import config
    from dagshub.upload import Repo

    from engine.kit.checkpoint import final_model_files

    owner, name = repository(options)
    files = final_model_files(output_dir)
    if not files:
        logger.warning("dagshub: no final model in %s to commit (train.save_final_model = false?)", output_dir)
        return

    def commit():
        if config.token is None and not (config.username and config.password):
            # a token `dagshub login` cached, or an error: not the client's OAuth prompt, no one answers it here
            dagshub.auth.get_authenticator(fail_if_no_token=True)
        folder = Repo(owner, name, branch=options.branch or os.environ.get("BRANCH") or None).directory(
            options.repo_path)
        for file in files:
            folder.add(str(output_dir / file), path=file)
        folder.commit(f"engine: final model of {output_dir.resolve().name}")

    call_with_timeout(commit, options.upload_timeout, "dagshub: committing the final model")

