"""Read back the experiments an offline SwanLab run wrote (``log_dir/run-*``), with SwanLab's own
record reader: what ``swanlab sync`` would upload."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class OfflineRun:
    folder: Path
    id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    resumed: bool = False  # started with resume="allow" (continues the experiment of its id)
    config: dict[str, Any] = field(default_factory=dict)
    scalars: dict[tuple[str, int], float] = field(default_factory=dict)
    texts: dict[tuple[str, int], list[tuple[str, str]]] = field(default_factory=dict)  # (caption, text) items
    state: str | None = None  # "finished", "crashed", ...; None: the run did not finish


def read_offline_runs(log_dir: str | Path) -> list[OfflineRun]:
    """One :class:`OfflineRun` per ``run-*`` folder under ``log_dir``, oldest first."""
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.proto.swanlab.run.v1.run_pb2 import ResumeMode, RunState
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs = []
    for folder in sorted(Path(log_dir).glob("run-*")):
        found = OfflineRun(folder)
        (run_file,) = folder.glob("*.swanlab")
        reader = DataStoreReader()
        reader.open(run_file)
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                start = record.start
                found.id, found.project, found.name, found.tags = start.id, start.project, start.name, list(start.tags)
                found.resumed = start.resume == ResumeMode.RESUME_MODE_ALLOW
            elif kind == "scalar":
                found.scalars[record.scalar.key, record.scalar.step] = record.scalar.value.number
            elif kind == "media":
                media = record.media
                found.texts[media.key, media.step] = [
                    (item.caption, (folder / "media" / "text" / item.filename).read_text(encoding="utf-8"))
                    for item in media.value.items]
            elif kind == "finish":
                found.state = RunState.Name(record.finish.state).removeprefix("RUN_STATE_").lower()
        reader.close()
        stored = yaml.safe_load((folder / "files" / "config.yaml").read_text(encoding="utf-8")) or {}
        found.config = {key: item["value"] for key, item in stored.items()}
        runs.append(found)
    return runs
