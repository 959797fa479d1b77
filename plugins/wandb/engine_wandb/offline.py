"""Read what an offline W&B run wrote (``WANDB_MODE=offline``): its id, config and history.

The ``run-<id>.wandb`` file is what ``wandb sync`` uploads: a 7-byte header (``:W&B``, magic
0xBEE1, version 0), then LevelDB-log framing (32 KiB blocks of records, each a 7-byte header:
crc32, length, type full/first/middle/last) around protobuf ``Record`` messages of
``wandb.proto.wandb_internal_pb2``. This reads that sync format with W&B's own message classes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    run_id: str
    name: str = ""
    project: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    scalars: dict[tuple[str, int], float] = field(default_factory=dict)  # (name, step) -> value
    tables: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # -> {"columns", "data"}
    exit_code: int | None = None


def records(path: str | Path) -> Iterator[Any]:
    """The protobuf records of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    offset, pending = FILE_HEADER.size, b""
    while offset + RECORD_HEADER.size <= len(data):
        if BLOCK - offset % BLOCK < RECORD_HEADER.size:  # the block's tail is padding
            offset += BLOCK - offset % BLOCK
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, offset)
        offset += RECORD_HEADER.size
        chunk, offset = data[offset:offset + length], offset + length
        if kind == 0 and length == 0:  # zeroed space at the end of a file still being written
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def _value(item: Any) -> Any:
    return json.loads(item.value_json)


def read_offline_runs(wandb_dir: str | Path) -> list[OfflineRun]:
    """The runs under a ``wandb`` folder, one per run id (a resumed run's folders merged)."""
    runs: dict[str, OfflineRun] = {}
    for path in sorted(Path(wandb_dir).glob("offline-run-*/run-*.wandb")):
        run = None
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                info = record.run
                run = runs.setdefault(info.run_id, OfflineRun(info.run_id))
                run.name, run.project, run.group, run.tags = info.display_name, info.project, info.run_group, list(info.tags)
                for item in record.run.config.update:
                    run.config[item.key] = _value(item)
            elif kind == "config" and run is not None:
                for item in record.config.update:
                    run.config[item.key] = _value(item)
            elif kind == "history" and run is not None:
                row: dict[str, Any] = {}
                for item in record.history.item:  # a logged object (a table) comes as one item per field
                    *parents, key = item.nested_key or [item.key]
                    folder = row
                    for parent in parents:
                        folder = folder.setdefault(parent, {})
                    folder[key] = _value(item)
                step = row.pop("_step", record.history.step.num)
                for name, value in row.items():
                    if not name.startswith("_") and isinstance(value, (int, float)):
                        run.scalars[name, step] = float(value)
                    elif isinstance(value, dict) and value.get("_type") == "table-file":  # the table's own file
                        run.tables[name, step] = json.loads((path.parent / "files" / value["path"]).read_text())
            elif kind == "exit" and run is not None:
                run.exit_code = record.exit.exit_code
    return list(runs.values())
