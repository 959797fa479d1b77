"""Helpers shared by tracker plugins (TensorBoard, MLflow, W&B, trackio).

* :func:`flatten_config` turns the composed config into flat ``"train.learning_rate"`` keys
  whose values a tracker accepts, within its limits on key and value length.
* :func:`scalar_metrics` keeps the numbers of a ``log_metrics`` call (trackers plot scalars).
* :func:`samples_table` renders a ``log_samples`` call as a markdown table (text trackers show);
  :func:`sample_rows` / :func:`sample_columns` as a table of text (trackers with tables).
* :func:`tracker_run_name` is the run's name for a tracker (``train.run_name`` or output_dir's).
* :func:`wait_for_server` asks a server whether it answers before a network client starts, for a
  bounded time and with a line on screen (clients retry for minutes, or wait forever).
* :class:`BackgroundSender` sends a slow client's calls from a thread so steps never wait on
  the network; an error it met is raised on the next call, where the isolated logging hooks
  report it by the plugin's name.
* :func:`call_with_timeout` waits a bounded time for a client call that can block on a server
  (starting a run, ending it); :func:`first_line` is an exception's message without a client's
  banner of lines.
* :class:`Tracker` is the base of a tracker plugin class: its options, its package checked at
  configure time, and the backend's run id kept in checkpoints.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any, Callable

from . import hookimpl
from .util import require

logger = logging.getLogger("engine")

TRUNCATED = "..."


def flatten_config(params: dict[str, Any], *, max_key_length: int | None = None,
                   max_value_length: int | None = None, tracker: str = "tracker") -> dict[str, Any]:
    """``{"train": {"learning_rate": 0.1}}`` -> ``{"train.learning_rate": 0.1}``.

    Values stay bool, int, float or str; lists become their JSON text and None the string
    ``"None"``. A string longer than ``max_value_length`` is cut to that length (ending in
    ``...``); a key longer than ``max_key_length`` is left out. Both are logged once as a
    warning naming ``tracker`` and the keys, so nothing goes missing silently.
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        elif value is None:
            flat[prefix] = "None"
        else:  # lists, empty dicts
            flat[prefix] = json.dumps(value, default=str)

    walk("", params)
    too_long = [key for key in flat if max_key_length is not None and len(key) > max_key_length]
    cut = []
    for key in too_long:
        del flat[key]
    if max_value_length is not None:
        for key, value in flat.items():
            text = value if isinstance(value, str) else None
            if text is not None and len(text) > max_value_length:
                flat[key] = text[: max_value_length - len(TRUNCATED)] + TRUNCATED
                cut.append(key)
    if too_long:
        logger.warning("%s: config keys longer than %d characters are not logged: %s", tracker, max_key_length,
                       ", ".join(too_long))
    if cut:
        logger.warning("%s: config values longer than %d characters are cut short: %s", tracker, max_value_length,
                       ", ".join(cut))
    return flat


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers among ``metrics`` as floats (bools and strings are not scalars to plot)."""
    return {key: float(value) for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def samples_table(samples: list[dict[str, Any]]) -> str:
    """``log_samples``' rows as a markdown table ``| step | prompt | completion |``; a chat prompt
    shows as its messages' ``role: content``; pipes and newlines are escaped so each row stays one."""

    def cell(value: Any) -> str:
        if isinstance(value, list):
            value = " / ".join(f"{m.get('role')}: {m.get('content')}" for m in value)
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| step | prompt | completion |", "| --- | --- | --- |"]
    lines += [f"| {row['step']} | {cell(row['prompt'])} | {cell(row['completion'])} |" for row in samples]
    return "\n".join(lines)


SAMPLE_COLUMNS = ["step", "prompt", "completion"]


def sample_rows(samples: list[dict[str, Any]]) -> list[list[Any]]:
    """``log_samples``' rows as ``[step, prompt, completion]`` lists under :data:`SAMPLE_COLUMNS`, for a
    tracker's table; a chat prompt becomes its messages' ``role: content`` lines."""

    def text(value: Any) -> str:
        if isinstance(value, list):
            return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in value)
        return str(value)

    return [[row["step"], text(row["prompt"]), text(row["completion"])] for row in samples]


def sample_columns(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """:func:`sample_rows` by column, ``{"step": [...], "prompt": [...], "completion": [...]}``
    (a table as MLflow's ``log_table`` and Azure ML's ``log_table`` take it)."""
    rows = sample_rows(samples)
    return {column: [row[index] for row in rows] for index, column in enumerate(SAMPLE_COLUMNS)}


def tracker_run_name(run: Any) -> str:
    """The run's name for trackers: ``train.run_name``, or output_dir's folder name."""
    return run.config.train.run_name or run.output_dir.resolve().name


def wait_for_server(url: str, timeout: float, plugin: str) -> None:
    """Return once the HTTP server at ``url`` answers (any status); a ConnectionError naming ``plugin``
    when nothing listens there, or when it does not answer within ``timeout`` seconds.

    Network clients retry a connection that fails for minutes (MLflow: about 4, with nothing on
    screen) or wait forever for a server that accepts and never answers (huggingface_hub's API
    calls have no timeout). Asking first bounds the start of a run: a refused connection or an
    unknown host fails at once, a silent server after ``timeout`` seconds (``<plugin>.connect_timeout``),
    with a line on screen while it waits. The isolated hooks report the error once (or end the
    run with strict); at configure time it is the plugin's refusal.
    """
    import ssl
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)  # without user:password@ (the answer is all that counts; nothing to show)
    url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    deadline = time.monotonic() + timeout
    waiting = False  # the line is shown once the server did not answer within a second
    while True:
        left = deadline - time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=max(left if waiting else min(left, 1.0), 0.1)):
                return
        except urllib.error.HTTPError:  # an error status (401, 404) is an answer
            return
        except OSError as exc:  # URLError (refused, unknown host), a timeout, a closed connection
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLError):  # it answered; the client checks certificates its own way
                return
            if not isinstance(reason, TimeoutError):
                raise ConnectionError(f"{plugin}: cannot reach {url}: {reason}") from None
            if waiting or time.monotonic() >= deadline:
                raise ConnectionError(f"{plugin}: {url} did not answer within {timeout:g} s "
                                      f"({plugin}.connect_timeout)") from None
            logger.info("%s: connecting to %s (timeout %g s)", plugin, url, timeout)
            waiting = True


class BackgroundSender:
    """Calls queued functions one by one on a daemon thread, in order.

    :meth:`submit` returns at once. An exception a call raised is kept and raised by the next
    :meth:`submit` or by :meth:`close` (nothing more is sent after it), so the caller's hook
    fails where the engine isolates and reports it. ``max_pending`` bounds the queue: a client
    that falls that far behind (a hung connection) fails the next :meth:`submit` at once, so
    steps neither wait for it nor fill memory; what is queued is dropped.
    """

    def __init__(self, name: str, max_pending: int = 1000):
        self.error: BaseException | None = None  # the first failure; nothing is sent after it
        self.name, self.max_pending = name, max_pending
        self._reported = False
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._work, name=f"engine-{name}-sender", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            try:
                if call is None:
                    return
                if self.error is None:
                    call()
            except BaseException as exc:  # kept for the caller's thread
                self.error = exc
            finally:
                self._queue.task_done()

    def _raise_error(self) -> None:
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error

    def submit(self, call: Callable[[], Any]) -> None:
        self._raise_error()
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self.error = TimeoutError(f"{self.name}: {self.max_pending} calls are waiting to be sent (the client "
                                      "hangs or is far behind); nothing more is sent")
            self._raise_error()

    def close(self, timeout: float = 60.0) -> None:
        """Send what is queued (waiting at most ``timeout`` seconds), stop the thread, raise an error."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)  # a full queue of a hung client: never freed
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name}: still sending after {timeout:g} s; the rest is dropped")
        self._raise_error()


def call_with_timeout(call: Callable[[], Any], timeout: float, what: str) -> None:
    """Run ``call()`` on a thread of its own and wait for it ``timeout`` seconds at most.

    For a client call that can block on a server that does not answer (clients retry for minutes):
    raises what ``call`` raised, or ``TimeoutError("<what> did not return within <timeout> s")``,
    leaving the thread to finish on its own (a daemon thread: it never holds the process's exit).
    """
    worker = BackgroundSender(what)
    worker.submit(call)
    try:
        worker.close(timeout=timeout)
    except TimeoutError:
        if worker.error is not None:  # the call's own TimeoutError
            raise
        raise TimeoutError(f"{what} did not return within {timeout:g} s") from None


def first_line(exc: BaseException) -> str:
    """The first line of text of an exception's message, without terminal colours and rules (clients
    such as W&B and Neptune raise messages of many lines of advice)."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines()]
    return next((line for line in lines if line and not line.startswith("---")), "")


class Tracker:
    """Base class of a tracker plugin (the entry point names the subclass: one instance per run).

    Subclasses set ``extra`` (the plugin's name), ``package`` (the module its client imports),
    ``distribution`` when pip names that package otherwise, and ``options`` (the options
    dataclass), and set ``self.run_id`` to the backend's id of the run once it exists: it is kept
    in checkpoints, and a resumed run finds it there to continue the same tracker run (None:
    nothing to keep). A missing package is refused at configure time (without importing it) with the pip command: the
    engine extra for a first-party tracker (``pip install 'engine[mlflow]'``), else the
    distribution (``pip install my-client``).
    """

    extra: str
    package: str
    distribution: str | None = None
    options: type

    def __init__(self):
        self.run_id: str | None = None

    @hookimpl
    def plugin_options(self):
        return self.options

    @hookimpl
    def configure(self, run):
        from .catalogue import FIRST_PARTY

        import importlib.util

        try:  # whether it is installed, without importing it: clients take seconds (engine plan waits on them)
            installed = importlib.util.find_spec(self.package) is not None
        except ImportError:  # its parent package is missing
            installed = False
        if not installed:
            require(self.package, self.distribution, feature=f"plugins = [{self.extra!r}]",
                    extra=self.extra if self.extra in FIRST_PARTY else None)

    @hookimpl
    def checkpoint_state(self, run):
        return {"run_id": self.run_id} if self.run_id else None

    @hookimpl
    def load_checkpoint_state(self, run, state):
        self.run_id = state.get("run_id")
