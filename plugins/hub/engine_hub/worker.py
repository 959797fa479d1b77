"""The upload process: ``python -m engine_hub.worker``, started by the training process.

Uploads run here rather than in a thread of the training process so that they share no GIL
with training (hashing and copying code in the upload libraries then never holds up a step), and
a library that hangs or crashes takes only this process down. On the tiny-model benchmark
(benchmarks/hub.py, 2 busy cores) a thread and this process cost the same: there the cost is CPU
time, not the GIL.

Protocol (pickle over pipes): stdin gets ``(target, retries, retry_delay, secret)`` and then one
:class:`engine_hub.Push` per push; for each, the process answers ``(step, error or None)`` on
the file descriptor that was its stdout. Its stdout proper goes to stderr, so what libraries
print never mixes with the answers. It ends when stdin closes.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any

from .targets import describe


def push(target: Any, job: Any, retries: int, retry_delay: float) -> str | None:
    """Upload every part of ``job``, retrying the whole push with backoff; the last error or None."""
    error = None
    for attempt in range(retries + 1):
        try:
            for folder, path_in_repo, ignore, replace in job.parts:
                target.upload(folder, path_in_repo, job.message, ignore, replace)
            return None
        except Exception as exc:
            error = describe(exc)
            if attempt < retries:
                time.sleep(retry_delay * 2 ** attempt)
    return error


def yield_to_training() -> None:
    """Upload on the CPU time training leaves: a push may take longer, a step never waits for one.

    The process already shares no GIL with training, but on a machine whose cores the steps keep busy
    (a CPU run; a GPU run's data loader workers) its hashing and copying took cores from them: 0.81-0.88x
    steps/s with a push every 10 steps on 2 cores (benchmarks/hub.py). Linux's idle class runs it only when a
    core has nothing else to do; elsewhere the lowest priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass


def main() -> None:
    yield_to_training()
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inbox = sys.stdin.buffer
    target, retries, retry_delay, secret = pickle.load(inbox)
    while True:
        try:
            job = pickle.load(inbox)
        except EOFError:
            return
        error = push(target, job, retries, retry_delay)
        if error and secret:
            error = error.replace(secret, "***")
        pickle.dump((job.step, error), answers)
        answers.flush()


if __name__ == "__main__":
    main()
