"""Read Neptune's offline runs back (``mode = "offline"``): what ``neptune sync`` would upload.

Each offline run is a folder ``<data directory>/offline/run__<container id>__<pid>__<random>``
holding ``metadata.json`` and ``data-<n>.log``: Neptune's operation queue, one JSON line
``{"obj": <operation>, "version": n}`` each, read here with Neptune's own operation classes
(``Operation.from_dict``); an uploaded file's content lies in ``upload_path/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class OfflineRun:
    container_id: str
    fields: dict[str, Any] = field(default_factory=dict)  # "sys/name" -> the value last assigned
    series: dict[str, dict[int, Any]] = field(default_factory=dict)  # "finetuning/loss" -> {step: value}
    files: dict[str, str] = field(default_factory=dict)  # "finetuning/samples/step_2" -> the file's text


def read_offline_runs(data_directory: str | Path) -> list[OfflineRun]:
    """The offline runs under a Neptune data directory, in the order they were created."""
    from neptune.internal.operation import (AssignBool, AssignFloat, AssignInt, AssignString, LogOperation, Operation,
                                            UploadFile)

    runs = []
    folders = sorted(Path(data_directory).glob("offline/run__*"),
                     key=lambda folder: json.loads((folder / "metadata.json").read_text())["createdAt"])
    for folder in folders:
        found = OfflineRun(json.loads((folder / "metadata.json").read_text())["containerId"])
        for log in sorted(folder.glob("data-*.log"), key=lambda path: int(path.stem.split("-")[1])):
            for line in log.read_text().splitlines():
                operation = Operation.from_dict(json.loads(line)["obj"])
                name = "/".join(operation.path)
                if isinstance(operation, (AssignBool, AssignFloat, AssignInt, AssignString)):
                    found.fields[name] = operation.value
                elif isinstance(operation, LogOperation):
                    found.series.setdefault(name, {}).update({value.step: value.value for value in operation.values})
                elif isinstance(operation, UploadFile) and operation.tmp_file_name:
                    found.files[name] = (folder / "upload_path" / operation.tmp_file_name).read_text()
        runs.append(found)
    return runs

