"""A run owns its output_dir: an OS lock for the run's life, a run record, and the rule for what a
new run may find there (the folder's layout: :mod:`engine.layout`).

:func:`claim` runs on the main process before anything loads:

* A folder whose lock a live process holds is refused at once, naming that PID. The kernel
  drops a flock when its holder dies, so a SIGKILLed run leaves no stale lock.
* A resumed run continues the run of its checkpoint: the same run id, one more entry in the
  record's ``starts``.
* A fresh run into a folder that holds another run's checkpoints or final model is refused with
  the fix (resume it, choose another output_dir, or ``train.overwrite_output_dir = true``, which
  first removes what the engine wrote there; files the engine did not write are never deleted).
* Resume (``resume_from_checkpoint = true``) and rotation only see this run's checkpoints.

This module imports no torch, so the CLI can take the lock before the heavy imports.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .config import START_KEYS
from .errors import CheckpointError, ConfigError, EngineError
from .layout import FINAL_MARKER, LOCK, MARKER, METRICS, MODEL_FILES, RECORD, RUN_FILES
from .util import dumps_json, write_json

if TYPE_CHECKING:
    from .state import RunView

logger = logging.getLogger("engine")



def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def env_rank(name: str = "RANK") -> int:
    """A rank from the launcher's environment (torchrun, deepspeed); 0 when not launched by one."""
    value = os.environ.get(name, "0")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; the launcher sets it "
                          f"(torchrun, deepspeed): unset it for a single process") from None


def is_main_process() -> bool:
    """Rank 0 of the launcher's environment (the strategy is not set up yet when this is asked)."""
    return env_rank() == 0


# ---------------------------------------------------------------------------- the lock


class OutputDirLock:
    """An exclusive ``flock`` on ``output_dir/run.lock``, held by this process until released."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.path = output_dir / LOCK
        self.created_dir = False
        self._handle: Any = None

    def acquire(self) -> None:
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ConfigError(f"train.output_dir: {self.output_dir} is a file, not a folder")
        while True:
            if not self.output_dir.is_dir():
                try:
                    self.output_dir.mkdir(parents=True)
                    self.created_dir = True
                except FileExistsError:
                    pass  # made meanwhile by another run, or a file: open() below says which
                except OSError as exc:
                    raise ConfigError(f"train.output_dir: cannot create {self.output_dir}: {exc.strerror}") from None
            try:
                handle = open(self.path, "a+", encoding="utf-8")
            except FileNotFoundError:
                continue  # the folder went away between the check and the open: make it again
            except OSError as exc:
                raise ConfigError(f"train.output_dir: cannot write in {self.output_dir}: {exc.strerror}") from None
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(handle)
                handle.close()
                raise ConfigError(f"train.output_dir: {self.output_dir} is in use by another run ({holder}); "
                                  "wait for it to end, or choose another train.output_dir") from None
            # a holder that gave up removes the lock file of a folder it made; a lock on that
            # unlinked file would guard nothing, so lock the file that is there now
            if _same_file(handle, self.path):
                break
            handle.close()
        handle.truncate(0)
        handle.write(f"PID {os.getpid()} on {socket.gethostname()}, since {now()}\n")
        handle.flush()
        self._handle = handle

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self) -> None:
        """Unlock; a folder this lock created and nothing else wrote to is removed again."""
        if self._handle is None:
            return
        unused = self.created_dir and [p.name for p in self.output_dir.iterdir()] == [LOCK]
        if unused:
            self.path.unlink()
        else:
            self._handle.truncate(0)
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None
        _HELD.pop(_key(self.output_dir), None)
        if unused:
            try:
                self.output_dir.rmdir()
            except OSError:
                pass  # another run put something there meanwhile


def _holder(handle: Any) -> str:
    """Who holds the lock: the line its holder writes right after locking."""
    for _ in range(50):
        handle.seek(0)
        text = handle.read().strip()
        if text:
            return text
        time.sleep(0.01)
    return "PID unknown"


def _same_file(handle: Any, path: Path) -> bool:
    try:
        return os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


_HELD: dict[str, OutputDirLock] = {}


def _key(output_dir: Path) -> str:
    return os.path.realpath(output_dir)


def lock_output_dir(output_dir: str | Path) -> OutputDirLock:
    """Lock ``output_dir`` for this process (creating it); the lock this process holds already is reused.

    The CLI locks before its heavy imports, so a busy folder is refused within a fraction of a
    second; the run then takes that lock over.
    """
    output_dir = Path(output_dir)
    lock = _HELD.get(_key(output_dir))
    if lock is None or not lock.held:
        lock = OutputDirLock(output_dir)
        lock.acquire()
        _HELD[_key(output_dir)] = lock
    return lock


# ---------------------------------------------------------------------------- the record


def read_record(output_dir: Path) -> dict[str, Any] | None:
    import json

    path = output_dir / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"train.output_dir: {path} is not valid JSON; it is the engine's run record: "
                          "restore it, or remove it to treat the folder's checkpoints as unclaimed") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ConfigError(f"train.output_dir: {path} is not an engine run record (no run_id)")
    return record


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def config_fingerprint(run: RunView) -> str:
    """A hash of the composed config, without the keys that only say how to start."""
    mapping = run.config.to_mapping()
    mapping["train"] = {k: v for k, v in mapping["train"].items() if k not in START_KEYS}
    return "sha256:" + hashlib.sha256(dumps_json(mapping, sort_keys=True).encode()).hexdigest()[:16]


def versions(run: RunView) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, Any] = {"engine": __version__, "python": sys.version.split()[0]}
    for package in ("torch", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    plugins = {}
    for name in run.config.plugins:
        installed = run.plugin_manager.installed.get(name)
        plugins[name] = f"{installed.distribution} {installed.version}" if installed and \
            name not in run.plugin_manager.objects else "python object"
    found["plugins"] = plugins
    return found


# ---------------------------------------------------------------------------- what a folder holds


def checkpoint_run_id(path: Path) -> str | None:
    """The run id a checkpoint's manifest names (None for one without a readable manifest)."""
    from .checkpoint import read_manifest

    try:
        return read_manifest(path, MARKER).get("run_id")
    except CheckpointError:  # an unreadable manifest claims no run
        return None


def _run_work(output_dir: Path, record: dict[str, Any] | None) -> dict[str | None, list[str]]:
    """What the folder holds, by the run id that wrote it: checkpoint names and "a final model"."""
    from .checkpoint import list_checkpoints, read_manifest

    work: dict[str | None, list[str]] = {}
    for path in list_checkpoints(output_dir):
        work.setdefault(checkpoint_run_id(path), []).append(path.name)
    if (output_dir / FINAL_MARKER).is_file():
        try:
            owner = read_manifest(output_dir, FINAL_MARKER).get("run_id")
        except CheckpointError:
            owner = None
        work.setdefault(owner, []).append("a final model")
    elif any((output_dir / name).is_file() for name in MODEL_FILES):
        # model files without the manifest: an unfinished final save of the recorded run, or a
        # model the engine did not write (owner None)
        work.setdefault(record["run_id"] if record else None, []).append("model files")
    if record is not None and record["run_id"] not in work and (output_dir / METRICS).is_file():
        # a run that saved nothing (it diverged, failed or saved no checkpoint): its logs are its work
        work[record["run_id"]] = [f"its {METRICS}, status {record.get('status', 'unknown')}"]
    return work


def _describe(run_id: str | None, items: list[str]) -> str:
    checkpoints = [i for i in items if i.startswith("checkpoint-")]
    parts = []
    if checkpoints:
        parts.append(f"{len(checkpoints)} checkpoint{'s' * (len(checkpoints) > 1)} up to {checkpoints[-1]}")
    parts += [i for i in items if not i.startswith("checkpoint-")]
    who = f"run {run_id}" if run_id else "files of an unknown run"
    return f"{who} ({', '.join(parts)})"


def _clear(output_dir: Path, owners: dict[str | None, list[str]], record: dict[str, Any] | None) -> None:
    """Remove what the engine wrote for the runs in ``owners`` (train.overwrite_output_dir)."""
    from .checkpoint import (
        delete_folder,
        final_model_files,
        list_checkpoints,
        read_manifest,
    )

    recorded = record["run_id"] if record else None
    if None in owners and (recorded is None or "model files" not in owners[None]):
        raise ConfigError(f"train.overwrite_output_dir: {output_dir} holds {_describe(None, owners[None])} "
                          "that no engine run claims; the engine deletes only what it wrote: move them "
                          "away or choose another train.output_dir")
    doomed = set(owners)
    for path in list_checkpoints(output_dir):
        if checkpoint_run_id(path) in doomed:
            delete_folder(path)
    try:
        final_owner = read_manifest(output_dir, FINAL_MARKER).get("run_id")
    except CheckpointError:
        final_owner = recorded  # no manifest: model files of the recorded run's unfinished save
    if final_owner in doomed:
        for name in [*final_model_files(output_dir), FINAL_MARKER, *MODEL_FILES]:
            (output_dir / name).unlink(missing_ok=True)
        for path in output_dir.glob("model-*-of-*.safetensors"):
            path.unlink()
    if recorded in doomed or recorded is None:
        for name in RUN_FILES:
            (output_dir / name).unlink(missing_ok=True)
    logger.info("train.overwrite_output_dir: removed %s from %s",
                "; ".join(_describe(owner, items) for owner, items in owners.items()), output_dir)


# ---------------------------------------------------------------------------- claiming a folder


@dataclass
class Claim:
    """What :func:`claim` decided: the checkpoint to resume (None: fresh) and the run id."""

    run_id: str
    resume_from: Path | None
    lock: OutputDirLock | None  # None on the other processes of a distributed run
    record: dict[str, Any] | None = None

    def start(self, run: RunView) -> None:
        """Write the run record (main process), once setup has succeeded: the run now owns the folder."""
        if self.lock is None:
            return
        output_dir = run.output_dir
        old = read_record(output_dir)
        record = old if old is not None and old["run_id"] == self.run_id else {
            "run_id": self.run_id, "created": now(), "config_fingerprint": None, "versions": None, "starts": []}
        record.update(config_fingerprint=config_fingerprint(run), versions=versions(run), status="running",
                      updated=now())
        record["starts"].append({"at": now(), "pid": os.getpid(), "host": socket.gethostname(),
                                 "resumed_from": str(self.resume_from) if self.resume_from else None,
                                 "step": run.state.global_step})
        write_json(output_dir / RECORD, record)
        self.record = record

    def finish(self, status: str, switched_off: dict[str, str] | None = None) -> None:
        """Record how the run ended ("finished", "failed", "diverged", "interrupted", "pruned") and
        which plugins were switched off after a failure, and unlock."""
        if self.lock is None:
            return
        try:
            if self.record is not None:
                self.record.update(status=status, updated=now(), switched_off=dict(switched_off or {}))
                write_json(self.lock.output_dir / RECORD, self.record)
        except OSError as exc:  # e.g. the disk filled up: say so, but keep the error that ended the run
            logger.warning("could not record the run's status in %s: %s", self.lock.output_dir / RECORD, exc)
        finally:
            self.lock.release()


def claim(run: RunView) -> Claim:
    """Lock ``output_dir`` and decide what this run is: fresh, or continuing a checkpoint's run.

    Runs before anything loads. A checkpoint to resume is found and checked here (the
    ``resolve_checkpoint`` and ``check_checkpoint`` hooks); a fresh run into another run's folder is refused, or the
    folder cleared with ``train.overwrite_output_dir``.
    """
    strategy = run.strategy
    if strategy.world_size == 1:
        return _claim_as_main(run)
    if not strategy.is_main_process:  # the main process decides; the others take its answer
        answer = strategy.broadcast_object(None)
        if isinstance(answer, EngineError):
            answer.shown_by_main = True
            raise answer
        run_id, resume_from = answer  # validated there (its structure is checked again as it loads)
        return Claim(run_id, Path(resume_from) if resume_from else None, None)
    try:
        claimed = _claim_as_main(run)
    except EngineError as exc:
        strategy.broadcast_object(exc)
        raise
    strategy.broadcast_object((claimed.run_id, str(claimed.resume_from) if claimed.resume_from else None))
    return claimed


def _claim_as_main(run: RunView) -> Claim:
    from .checkpoint import remove_partial

    output_dir = run.output_dir
    lock = lock_output_dir(output_dir)
    try:
        remove_partial(output_dir)
        record = read_record(output_dir)
        resume_from = _resume_checkpoint(run, record["run_id"] if record else None)
        run_id = (checkpoint_run_id(resume_from) if resume_from else None) or new_run_id()
        others = {owner: items for owner, items in _run_work(output_dir, record).items() if owner != run_id}
        if others:
            if not run.config.train.overwrite_output_dir:
                held = "; ".join(_describe(owner, items) for owner, items in others.items())
                resumable = any(item.startswith("checkpoint-") for items in others.values() for item in items)
                resume = "continue it with train.resume_from_checkpoint = true, " if resumable else ""
                if run.config.train.resume_from_checkpoint is True and resume_from is None:
                    held, resume = f"{held} but none of its checkpoints to resume", ""
                raise ConfigError(f"train.output_dir: {output_dir} holds {held}; {resume}choose another "
                                  "train.output_dir, or set train.overwrite_output_dir = true to remove it first")
            _clear(output_dir, others, record)
    except BaseException:
        lock.release()
        raise
    return Claim(run_id, resume_from, lock)


def _resume_checkpoint(run: RunView, folder_run_id: str | None) -> Path | None:
    """The checkpoint the run continues (``resolve_checkpoint``), checked (``check_checkpoint``); None: fresh."""
    found = run.hook.resolve_checkpoint(run=run, run_id=folder_run_id)
    if found is None:
        return None
    path = Path(found)
    run.hook.check_checkpoint(run=run, path=path)
    return path
