"""``data.streaming``: a stream that counts the examples it handed out, so a checkpoint records the
position and a resumed run starts exactly where it stopped.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, NoReturn

import torch

from engine.errors import ConfigError


def raise_explained(error: Exception, explain: Callable[[Exception], Exception] | None) -> NoReturn:
    """Raise what ``explain`` makes of ``error`` (one line for the user), or ``error`` itself with its traceback."""
    explained = explain(error) if explain else error
    if explained is error:
        raise error
    raise explained from None


class ResumableStream(torch.utils.data.IterableDataset):
    """A streaming datasets ``IterableDataset`` that counts the examples it has handed out in
    the current pass, so a checkpoint records the position and a resumed run starts exactly
    there: it reads the stream again (same seed, same shuffle buffer) and skips what was used.
    datasets' own ``state_dict()`` would lose the shuffle buffer's contents on resume.

    The count is exact because the DataLoader reads it in this process
    (``train.dataloader_num_workers = 0``) and takes examples only as batches are needed.

    What reading raises goes through ``explain`` (a bad row found mid-training becomes one line naming
    it); a pass that gives no example at all is refused (the loop would wait for one forever).
    """

    def __init__(self, rows: Any, key: str = "data.train",
                 explain: Callable[[Exception], Exception] | None = None):
        self.rows, self.key, self.explain = rows, key, explain
        self.epoch = 0
        self.position = 0  # examples handed out in this pass
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        self.rows.set_epoch(self.epoch)  # a new shuffle each pass
        examples = iter(self.rows)
        skip, self._skip = self._skip, 0
        try:
            for _ in itertools.islice(examples, skip):
                pass
            self.position = skip
            for example in examples:
                self.position += 1
                yield example
        except Exception as exc:
            raise_explained(exc, self.explain)
        if self.position == 0:
            raise ConfigError(f"{self.key}: a whole pass over the stream gave no example: every row was left out "
                              "(longer than data.max_length with data.truncation = \"drop\", or with no token to "
                              "learn), or there are none")
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip = int(state["epoch"]), int(state["position"])
