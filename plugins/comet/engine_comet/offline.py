"""Read Comet's offline archives back (``online = false``): what ``comet upload`` would send.

An archive ``<experiment key>-<random>.zip`` holds ``experiment.json`` (key, project, workspace,
tags, the error reported) and ``messages.json``: one JSON message per line (``parameter_msg``,
``metric_msg``, ``log_other``, ``file_upload`` naming a file of the archive, ...), as Comet's own
``comet offline`` command reads them. A resumed run writes a second archive under the same key;
``comet upload`` appends it to the first experiment, and this reader merges them the same way.
"""

from __future__ import annotations

import csv
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comet_ml.config import OFFLINE_EXPERIMENT_JSON_FILE_NAME, OFFLINE_EXPERIMENT_MESSAGES_JSON_FILE_NAME


@dataclass
class OfflineExperiment:
    key: str
    name: str = ""
    project_name: str | None = None
    workspace: str | None = None
    tags: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)  # Comet's flat names: "train|learning_rate"
    scalars: dict[tuple[str, int], float] = field(default_factory=dict)  # (name, step) -> value
    tables: dict[str, list[list[str]]] = field(default_factory=dict)  # file name -> rows, the header first
    errors: list[str] = field(default_factory=list)  # the error each archive reported (crashed runs)
    archives: int = 0


def read_offline_archives(folder: str | Path) -> list[OfflineExperiment]:
    """The experiments whose archives lie in ``folder``, one per key, archives merged by start time."""
    opened = [zipfile.ZipFile(path) for path in sorted(Path(folder).glob("*.zip"))]
    metas = [json.loads(archive.read(OFFLINE_EXPERIMENT_JSON_FILE_NAME)) for archive in opened]
    experiments: dict[str, OfflineExperiment] = {}
    for meta, archive in sorted(zip(metas, opened), key=lambda pair: pair[0]["start_time"]):
        found = experiments.setdefault(meta["offline_id"], OfflineExperiment(meta["offline_id"]))
        found.project_name, found.workspace, found.tags = meta["project_name"], meta["workspace"], meta["tags"]
        found.archives += 1
        if meta.get("customer_error_reported"):
            found.errors.append(meta.get("customer_error_message"))
        for line in archive.read(OFFLINE_EXPERIMENT_MESSAGES_JSON_FILE_NAME).splitlines():
            _read_message(found, archive, json.loads(line))
    return list(experiments.values())


def _read_message(found: OfflineExperiment, archive: zipfile.ZipFile, message: dict[str, Any]) -> None:
    payload = message["payload"]
    if message["type"] == "parameter_msg":
        param = payload.get("param") or payload["params"]  # "params": a list value
        if param["source"] == "manual":
            found.params[param["paramName"]] = param["paramValue"]
    elif message["type"] == "metric_msg":
        metric = payload["metric"]
        found.scalars[metric["metricName"], metric["step"]] = float(metric["metricValue"])
    elif message["type"] == "log_other" and payload["key"] == "Name":
        found.name = payload["value"]
    elif message["type"] == "file_upload" and payload["file_path"] in archive.namelist():
        name = (payload.get("additional_params") or {}).get("fileName") or ""
        if name.endswith(".csv"):
            text = archive.read(payload["file_path"]).decode("utf-8")
            found.tables[name] = list(csv.reader(io.StringIO(text)))
