"""Write the tiny example datasets of this folder (deterministic; rerun to recreate them).

    python examples/data/generate.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
GOOD, BAD = ["great", "fine", "lovely", "bright"], ["awful", "dull", "broken", "sad"]
PLAIN = ["the", "day", "was", "a", "film", "and", "food", "very", "quite", "it"]
ANIMALS = [["fox"], ["brown", "bear"], ["dog"], ["barn", "owl"]]
PLACES = [["paris"], ["new", "york"], ["the", "river"]]


def write(name, rows):
    with open(HERE / name, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def sentiment(rng):
    """text + label: 0 negative, 1 neutral, 2 positive (more good than bad words: positive)."""
    for _ in range(96):
        words = [rng.choice(PLAIN + GOOD + BAD) for _ in range(rng.randint(4, 9))]
        score = sum(w in GOOD for w in words) - sum(w in BAD for w in words)
        yield {"text": " ".join(words), "label": 0 if score < 0 else 1 if score == 0 else 2}


def entities(rng):
    """tokens + tags (IOB2 strings): ANIMAL and PLACE names in plain words."""
    for _ in range(96):
        tokens, tags = [], []
        while len(tokens) < rng.randint(5, 10):
            pick = rng.random()
            if pick < 0.35:
                kind, names = ("ANIMAL", ANIMALS) if pick < 0.2 else ("PLACE", PLACES)
                name = rng.choice(names)
                tokens += name
                tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(name) - 1)
            else:
                tokens.append(rng.choice(PLAIN))
                tags.append("O")
        yield {"tokens": tokens, "tags": tags}


def reversals(rng):
    """source + target: the words of the source in reverse order."""
    for _ in range(96):
        words = [rng.choice(PLAIN + GOOD) for _ in range(rng.randint(2, 5))]
        yield {"source": " ".join(words), "target": " ".join(reversed(words))}


def completions(pairs):
    """prompt + completion (SFT): the reversal asked for and given."""
    for pair in pairs:
        yield {"prompt": f"reverse: {pair['source']}\nanswer:", "completion": f" {pair['target']}"}


def preferences(pairs):
    """prompt + chosen + rejected (DPO): the reversal preferred to the words as they came."""
    for pair in pairs:
        yield {"prompt": f"reverse: {pair['source']}\nanswer:", "chosen": f" {pair['target']}",
               "rejected": f" {pair['source']}"}


if __name__ == "__main__":
    rng = random.Random(0)
    write("sentiment.jsonl", sentiment(rng))
    write("entities.jsonl", entities(rng))
    pairs = list(reversals(rng))
    write("reversals.jsonl", pairs)
    write("reversal_completions.jsonl", completions(pairs))
    write("reversal_preferences.jsonl", preferences(pairs[:48]))
