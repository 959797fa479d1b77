"""Write docs/trainer-arguments.md from the table in engine/builtin/trainer_args.py.

    python docs/generate_trainer_arguments.py      # rewrite docs/trainer-arguments.md
tests/test_migrate.py fails when the file is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUTPUT = Path(__file__).with_name("trainer-arguments.md")

INTRO = """\
Every field of `transformers.TrainingArguments` has one answer here:

* **accepted**: a `[train]` key with Trainer's meaning and default (the same name, or the engine's name for it);
* **plugin**: provided by a named plugin, the value going to that plugin's section;
* **builtin**: the engine always behaves as Trainer's default does; there is no switch;
* **refused**: no counterpart, with the reason and what to use instead;
* **not yet**: no counterpart yet.

`engine migrate args.json -o run.toml` converts a `TrainingArguments.to_json_string()` dump
(`engine.migrate(training_args)` from Python) into a run file with these answers: values at
Trainer's default are written only where the engine's default differs, and every value set away
from Trainer's default that has no counterpart is listed with its reason (on stderr and at the top
of the run file). TrainingArguments names no model and no data: `[train] model` and `[data] train`
are left as commented keys to fill in."""


def _row(name: str, answer) -> str:
    from engine.builtin.trainer_args import answer_for

    answer = answer_for(name)  # a field a plugin answers: the installed plugin's answer
    return f"| `{name}` | {answer.describe(name).replace('|', chr(92) + '|')} |"


def render() -> str:
    from engine.builtin.trainer_args import FIELDS, LEGACY, SEQ2SEQ_FIELDS, TRANSFORMERS_VERSION
    from engine.kit.mappings import KINDS

    counts = ", ".join(f"{sum(a.kind == kind for a in FIELDS.values())} {kind}" for kind in KINDS)
    lines = ["# TrainingArguments in the engine", "",
             "Generated from `engine/builtin/trainer_args.py` by `python docs/generate_trainer_arguments.py`; do not edit.",
             "", INTRO, "",
             f"## The {len(FIELDS)} fields of transformers {TRANSFORMERS_VERSION}", "", f"{counts}.", "",
             "| field | answer |", "| --- | --- |"]
    lines += [_row(name, answer) for name, answer in FIELDS.items()]
    lines += ["", "## Seq2SeqTrainingArguments", "",
              "The fields `Seq2SeqTrainingArguments` adds, for a `Seq2SeqTrainer` run (`[train] task = \"seq2seq\"`).",
              "", "| field | answer |", "| --- | --- |"]
    lines += [_row(name, answer) for name, answer in SEQ2SEQ_FIELDS.items()]
    lines += ["", "## Names of older releases", "",
              "Found in dumps written by older transformers; converted as the names they became.", "",
              "| field | answer |", "| --- | --- |"]
    lines += [_row(name, answer) for name, answer in LEGACY.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
