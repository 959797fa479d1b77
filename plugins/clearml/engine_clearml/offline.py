"""Read back an offline ClearML session (``<cache>/offline/<task id>`` or its zip): what
``Task.import_offline_session`` would upload, from the files ClearML wrote."""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import SECTION


@dataclass
class OfflineSession:
    id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)  # the section "engine", as ClearML stores it (text)
    scalars: dict[tuple[str, str, int], float] = field(default_factory=dict)  # (plot, series, iteration)
    tables: dict[tuple[str, str, int], dict[str, Any]] = field(default_factory=dict)  # {"columns", "data"}


def read_offline_session(path: str | Path) -> OfflineSession:
    """The session in the folder or zip file ``path``."""
    path = Path(path)
    if path.is_dir():
        files = {name: (path / name).read_text(encoding="utf-8") for name in ("task.json", "metrics.jsonl")
                 if (path / name).is_file()}
    else:
        with zipfile.ZipFile(path) as archive:
            files = {name: archive.read(name).decode("utf-8") for name in ("task.json", "metrics.jsonl")
                     if name in archive.namelist()}
    task = json.loads(files["task.json"])
    found = OfflineSession(id=task["id"], project=task["project_name"], name=task["name"], tags=task.get("tags", []),
                           params={name: item["value"]
                                   for name, item in task.get("hyperparams", {}).get(SECTION, {}).items()})
    for line in files.get("metrics.jsonl", "").splitlines():  # a JSON list of events per report batch
        for event in json.loads(line):
            key = (event["metric"], event["variant"], event["iter"])
            if event["type"] == "training_stats_scalar":
                found.scalars[key] = event["value"]
            elif event["type"] == "plot":
                (table,) = json.loads(event["plot_str"])["data"]
                found.tables[key] = {"columns": table["header"]["values"],
                                     "data": [list(row) for row in zip(*table["cells"]["values"])]}
    return found
