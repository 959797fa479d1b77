"""engine-hub: push a run's checkpoints and final model to a model repo, the way Trainer's
``hub_strategy`` does, in a background process (steps never wait for an upload).

Strategies (what the repo holds after the run):

* ``end``: the final model (weights, config, tokenizer, ``model_complete``) and a model card
  (``README.md``) at the root.
* ``every_save``: the same, and the model of each checkpoint at the root while training (no
  optimizer, scheduler, RNG or engine state).
* ``checkpoint``: like every_save, and the latest whole checkpoint in ``last-checkpoint/``, so
  ``train.resume_from_checkpoint = "hub"`` resumes from the repo.
* ``all_checkpoints``: like every_save, and every checkpoint whole as ``checkpoint-<step>/``.

Uploads run in a separate process (engine_hub/worker.py), so they share no GIL with training.
A push is skipped while the previous one is still uploading (``always_push`` queues it
instead); the push at the end catches up with the newest checkpoint, waits for everything
pending and reports failed pushes once. A failed push is retried with backoff and never ends
the run (``strict = true`` makes it fatal). The token is masked in everything the engine writes.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine import ConfigError, PluginError, hookimpl, option
# the upload process imports this package to read its jobs: what imports torch is imported where it is used
from engine.kit.layout import FINAL_MARKER, MARKER, TMP

from .card import write_model_card
from .targets import RemoteMissing, Target, describe, is_filesystem, is_repo_id, open_target

logger = logging.getLogger("engine.hub")

LAST_CHECKPOINT = "last-checkpoint"
RESUME_NAME = "hub"
# what a checkpoint holds besides the model: never pushed with the model at the root
TRAINING_STATE = ["optimizer*", "scheduler.pt", "rng_state*.pt", "engine_state.pt", "trainer_state.json", MARKER]
STAGING = TMP + "hub"  # output_dir/.tmp-hub/: snapshots being pushed (removed at the next start if left)
DOWNLOAD = TMP + "hub-checkpoint"  # output_dir/.tmp-hub-checkpoint/: the checkpoint fetched to resume


@dataclass
class HubOptions:
    repo: str = option(nonempty=True, help=(
        "a Hub repo id 'user/model' (a bare 'model' goes under the token owner's namespace, as Trainer's "
        "hub_model_id), or a filesystem target: a path, a file:// URL or any fsspec URL (s3://... with s3fs)"))
    strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = option("every_save", help=(
        "what to push: end (the final model), every_save (also each checkpoint's model), checkpoint "
        "(also the latest whole checkpoint in last-checkpoint/), all_checkpoints (each as checkpoint-<step>/)"))
    private: bool = option(False, help="create the Hub repo private (needs a token)")
    revision: str | None = option(None, nonempty=True, help="the Hub branch to push to (created if missing)")
    token: str | None = option(None, nonempty=True, secret=True, help=(
        "Hub token; default HF_TOKEN or the cached login. Never logged nor written to any file"))
    always_push: bool = option(False, help=(
        "queue a push while the previous one is still uploading, instead of skipping it"))
    commit_message: str = option("Training in progress, step {step}", nonempty=True, help=(
        "message of the pushes during training ({step} is the step); the end pushes 'End of training'"))
    retries: int = option(3, min=0, help="retries of a failed push, waiting retry_delay, then twice as long, ...")
    retry_delay: float = option(2.0, min=0, help="seconds before the first retry")
    connect_timeout: float = option(20.0, min=1, help=(
        "seconds to wait for the Hub (HF_ENDPOINT) to answer when the run starts; a Hub that does not is refused"))
    strict: bool = option(False, help="a failed push ends the run (default: reported at the end, training goes on)")


@dataclass
class Push:
    """One push: folders to upload (local folder, path in repo, ignore patterns, replace) as one unit."""

    step: int
    message: str
    parts: list[tuple[Path, str, list[str], bool]]
    staging: Path | None = None  # removed once pushed
    final: bool = False


class Pusher:
    """Hands pushes to the upload process (engine_hub/worker.py: no GIL shared with training),
    in order; a thread here collects the answers."""

    def __init__(self, target: Target, retries: int, retry_delay: float, secret: str | None):
        self.target = target
        self.process = subprocess.Popen([sys.executable, "-m", "engine_hub.worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
        pickle.dump((target, retries, retry_delay, secret), self.process.stdin)
        self.process.stdin.flush()
        self.queued: list[Push] = []  # sent, not answered yet
        self.ended: str | None = None  # why the upload process is gone, once it is
        self.done = threading.Condition()
        self.failures: list[str] = []
        self.pushed: list[int] = []  # steps pushed, in order
        self.reader = threading.Thread(target=self._read, name="engine-hub", daemon=True)
        self.reader.start()

    @property
    def busy(self) -> bool:
        with self.done:
            return bool(self.queued)

    def submit(self, push: Push) -> None:
        with self.done:
            if self.ended is not None:  # the upload process is gone: nothing will answer
                self._answer(push, self.ended)
                return
            self.queued.append(push)
        try:
            pickle.dump(push, self.process.stdin)
            self.process.stdin.flush()
        except OSError:  # the upload process is gone: the reader reports what was queued
            pass

    def _read(self) -> None:
        while True:
            try:
                step, error = pickle.load(self.process.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            with self.done:
                self._answer(self.queued.pop(0), error)
        status = self.process.wait()
        with self.done:
            self.ended = f"the upload process ended (exit status {status})"
            while self.queued:
                self._answer(self.queued.pop(0), self.ended)

    def _answer(self, push: Push, error: str | None) -> None:
        if error is None:
            self.pushed.append(push.step)
            logger.debug("hub: pushed step %d to %s", push.step, self.target.description)
        else:
            self.failures.append(f"{'the final model' if push.final else f'step {push.step}'}: {error}")
        if push.staging is not None:
            shutil.rmtree(push.staging, ignore_errors=True)
        self.done.notify_all()

    def wait(self) -> None:
        """Until every push submitted so far is answered."""
        with self.done:
            self.done.wait_for(lambda: not self.queued)

    def close(self) -> None:
        """Wait for every pending push (with a line saying so), then end the upload process."""
        if self.busy:
            count = len(self.queued)
            logger.info("hub: waiting for %d pending push%s to %s", count, "es" * (count > 1),
                        self.target.description)
        self.wait()
        try:
            self.process.stdin.close()
        except OSError:  # already gone
            pass
        self.reader.join()


def resolve_token(options: HubOptions) -> str | None:
    if options.token:
        return options.token
    import huggingface_hub

    return huggingface_hub.get_token()  # HF_TOKEN, then the cached login


class Hub:
    """The plugin: one instance per run."""

    def __init__(self):
        self.options: HubOptions | None = None
        self.target: Target | None = None
        self.pusher: Pusher | None = None
        self.token: str | None = None
        self.latest: Path | None = None  # the newest checkpoint saved
        self.count = 0  # snapshots made, to name them
        self.submitted: set[int] = set()  # steps whose checkpoint was handed to the pusher
        self.pushed: list[int] = []  # steps pushed, in order (the final model's too), once the run is over
        self.metrics: dict[str, float] = {}  # the last value of each metric logged, for the model card

    @hookimpl
    def plugin_options(self):
        return HubOptions

    @hookimpl
    def configure(self, run):
        options = run.config.section("hub")
        repo = options.repo
        if is_filesystem(repo):
            for key in ("private", "revision"):
                if getattr(options, key):
                    raise ConfigError(f"hub.{key}: applies to Hub repos only; {repo!r} is a filesystem target")
        elif not is_repo_id(repo):
            raise ConfigError(f"hub.repo: {repo!r} is neither a Hub repo id 'user/model' or 'model' (letters, digits, "
                              "-_. ; no '--' or '..') nor a filesystem target (a path starting with / ./ ~, or a URL)")
        if options.strategy == "end" and not run.config.train.save_final_model:
            raise ConfigError("hub.strategy = 'end' pushes the final model, but train.save_final_model = false")
        if options.strategy == "checkpoint" and run.config.train.save_strategy == "no":
            logger.warning("hub.strategy = 'checkpoint' with train.save_strategy = 'no': no checkpoint to push")
        self.token = None if is_filesystem(repo) else resolve_token(options)
        if not is_filesystem(repo) and "/" not in repo and not self.token:
            raise ConfigError(f"hub.repo: {repo!r} goes under your Hub namespace (as Trainer's hub_model_id does), which "
                              "needs a token to know: set hub.token or HF_TOKEN, log in with `hf auth login`, or write "
                              f"'user/{repo}'")
        if options.private and not self.token:
            raise ConfigError("hub.private = true needs a token to create the repo: set hub.token or HF_TOKEN, "
                              "or log in with `hf auth login`")
        self.options = options
        self.target = open_target(repo, self.token, options.private, options.revision, options.connect_timeout)
        from engine.kit.distributed import is_main_process

        if is_main_process():  # before the strategy exists: the launcher's rank
            self.target.check()

    # ------------------------------------------------------------------ resume from the repo

    @hookimpl
    def locate_checkpoint(self, run, spec):
        if spec not in (RESUME_NAME, self.options.repo):
            return None
        local = run.output_dir / DOWNLOAD
        shutil.rmtree(local, ignore_errors=True)
        try:
            self.target.download(LAST_CHECKPOINT, local)
        except RemoteMissing:
            raise ConfigError(f"train.resume_from_checkpoint = {spec!r}: {self.target.description} has no "
                              f"{LAST_CHECKPOINT}/ (pushed by hub.strategy = 'checkpoint')") from None
        except Exception as exc:
            shutil.rmtree(local, ignore_errors=True)
            raise ConfigError(f"train.resume_from_checkpoint = {spec!r}: cannot download {LAST_CHECKPOINT}/ from "
                              f"{self.target.description}: {describe(exc)}") from None
        logger.info("hub: fetched %s/ from %s", LAST_CHECKPOINT, self.target.description)
        return str(local)

    # ------------------------------------------------------------------ pushing

    def _start(self) -> Pusher:
        if self.pusher is None:
            options = self.options
            self.pusher = Pusher(self.target, options.retries, options.retry_delay, self.token)
        return self.pusher

    def _staging(self, run) -> Path:
        self.count += 1
        return run.output_dir / STAGING / str(self.count)

    def _checkpoint_push(self, run, path: Path, step: int, message: str) -> Push:
        from engine.kit.checkpoint import snapshot_files

        snapshot = snapshot_files(path, self._staging(run))
        parts = [(snapshot, "", TRAINING_STATE, False)]
        if self.options.strategy == "checkpoint":
            parts.append((snapshot, LAST_CHECKPOINT, [], True))
        elif self.options.strategy == "all_checkpoints":
            parts.append((snapshot, path.name, [], True))
        return Push(step, message, parts, snapshot)

    @hookimpl
    def on_train_start(self, run):
        if run.strategy.is_main_process and self.options.strategy != "end":
            self._start()  # the upload process starts now rather than within a step

    @hookimpl
    def on_checkpoint_saved(self, run, path):
        options = self.options
        self.latest = Path(path)
        pusher = self._start()
        if options.strict and pusher.failures:
            raise PluginError(f"hub: push failed: {pusher.failures[0]}")
        if options.strategy == "end":
            return
        if pusher.busy and not options.always_push:
            logger.debug("hub: step %d not pushed: the previous push is still uploading", run.state.global_step)
            return
        self._submit(run, pusher, self.latest, run.state.global_step)

    def _submit(self, run, pusher: Pusher, path: Path, step: int) -> None:
        self.submitted.add(step)
        pusher.submit(self._checkpoint_push(run, path, step, self.options.commit_message.format(step=step)))

    @hookimpl
    def log_metrics(self, metrics):
        self.metrics.update(metrics)

    @hookimpl
    def log_finish(self, run, status):
        pusher = self._start()
        try:
            if status == "success":
                self._push_final(run, pusher)
            pusher.close()
            self.pushed = pusher.pushed
            shutil.rmtree(run.output_dir / STAGING, ignore_errors=True)
            shutil.rmtree(run.output_dir / DOWNLOAD, ignore_errors=True)
        finally:
            self.pusher = None
        if pusher.failures:
            more = f" (and {len(pusher.failures) - 1} more)" if len(pusher.failures) > 1 else ""
            message = (f"hub: {len(pusher.failures)} push(es) to {self.target.description} failed; the local "
                       f"checkpoints and model in {run.output_dir} are intact: {pusher.failures[0]}{more}")
            if self.options.strict:
                raise PluginError(message)
            logger.warning(message)

    def _push_final(self, run, pusher: Pusher) -> None:
        options, step = self.options, run.state.global_step
        latest = self.latest
        # the newest checkpoint, when its push was skipped (the previous one was uploading)
        if latest is not None and options.strategy != "end" and latest.is_dir() and \
                _saved_step(latest) not in self.submitted:
            self._submit(run, pusher, latest, _saved_step(latest))
        if not run.config.train.save_final_model:
            return
        from engine.kit.checkpoint import final_model_files, snapshot_files

        snapshot = snapshot_files(run.output_dir, self._staging(run), [*final_model_files(run.output_dir), FINAL_MARKER])
        write_model_card(run, snapshot / "README.md", options, self.metrics)
        pusher.submit(Push(step, "End of training", [(snapshot, "", [], False)], snapshot, final=True))

    @hookimpl
    def trainer_argument_mappings(self):
        from .mappings import TRAINER_ARGUMENTS  # for engine migrate only: runs do not load it

        return TRAINER_ARGUMENTS


def _saved_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])
