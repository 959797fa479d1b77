"""train.task: sequence classification, token classification and seq2seq (with generation-based
evaluation), each against transformers' Trainer / Seq2SeqTrainer on the same tiny model built from
config, the same data and the same schedule; the example run files; resume; bad inputs.

The reference data is tokenized by the code of transformers' example scripts (run_glue, run_ner,
run_summarization), copied below, and batched by transformers' collators; the engine tokenizes the
same raw rows itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import engine
from engine.builtin.data.tokenizer import train_tokenizer
from engine.testing import assert_resume_is_exact

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 12  # two epochs of 48 rows
# per-step training losses, engine vs Trainer: the engine logs them rounded to 6 decimals (5e-7); measured
# differences are at most 5.4e-7
LOSS_TOLERANCE = 1e-6
SCHEDULE = {"max_steps": STEPS, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8,
            "learning_rate": 3e-3, "logging_steps": 1, "optim": "adamw_torch", "save_strategy": "no",
            "train_sampling_strategy": "sequential", "seed": 0, "disable_tqdm": True}
BERT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
T5 = dict(d_model=32, d_ff=64, d_kv=16, num_layers=1, num_decoder_layers=1, num_heads=2, dropout_rate=0.0)


def rows(name: str, count: int | None = None):
    import datasets

    data = datasets.load_dataset("json", data_files=str(EXAMPLES / "data" / name), split="train")
    return data.select(range(count)) if count else data


def tokenizer_for(texts, eos_after_each=False):
    """A byte-level BPE tokenizer trained on ``texts``; with ``eos_after_each`` it appends eos to
    every text it encodes, as T5's tokenizer does."""
    tokenizer = train_tokenizer(texts, 300)
    if eos_after_each:
        from tokenizers.processors import TemplateProcessing

        eos = tokenizer.eos_token
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tokenizer.eos_token_id)])
    return tokenizer


def trainer_args(tmp_path, cls=transformers.TrainingArguments, **extra):
    return cls(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True, **{**SCHEDULE, **extra})


def engine_run(tmp_path, model, tokenizer, train, evaluation, train_keys=None, data=None, **kwargs):
    run = engine.Run({"train": {**SCHEDULE, "output_dir": str(tmp_path / "engine"), "save_final_model": False,
                                **(train_keys or {})},
                      "data": {"max_length": 24, **(data or {})}},
                     model=model, tokenizer=tokenizer, train_dataset=train, eval_dataset=evaluation, **kwargs)
    run.train()
    return run


def losses(log_history):
    return [entry["loss"] for entry in log_history if "loss" in entry and "train_loss" not in entry]


def assert_same_losses(run, trainer):
    ours, theirs = losses(run.state.log_history), losses(trainer.state.log_history)
    assert len(ours) == len(theirs) == STEPS
    assert ours[0] != ours[-1]  # it trains
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOSS_TOLERANCE)


def accuracy(prediction):
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


# ---------------------------------------------------------------------------- against Trainer


def test_sequence_classification_matches_trainer(tmp_path):
    raw = rows("sentiment.jsonl", 64)
    train, evaluation = raw.select(range(48)), raw.select(range(48, 64))
    tokenizer = tokenizer_for(raw["text"])

    def bert(seed=0):
        torch.manual_seed(seed)
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=len(tokenizer), num_labels=3, pad_token_id=tokenizer.pad_token_id, **BERT))

    # the model says the task; the engine tokenizes the text and label columns itself
    run = engine_run(tmp_path, bert(), tokenizer, train, evaluation, compute_metrics=accuracy)
    assert run.task == "sequence-classification"
    ours = run.evaluate()

    def preprocess(examples):  # run_glue.py's preprocess_function
        result = tokenizer(examples["text"], padding=False, max_length=24, truncation=True)
        result["label"] = examples["label"]
        return result

    reference = [d.map(preprocess, batched=True, remove_columns=d.column_names) for d in (train, evaluation)]
    trainer = transformers.Trainer(model=bert(), args=trainer_args(tmp_path), train_dataset=reference[0],
                                   eval_dataset=reference[1], compute_metrics=accuracy,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    theirs = trainer.evaluate()
    assert_same_losses(run, trainer)
    assert ours["eval_accuracy"] == theirs["eval_accuracy"]
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-5)


def token_f1(predictions, labels):
    """Micro F1 over the labelled sub-words of the tags other than O (id 0), computed here."""
    predicted = predictions.argmax(-1)
    keep = labels != -100
    predicted, labels = predicted[keep], labels[keep]
    hits = ((predicted == labels) & (labels != 0)).sum()
    precision, recall = hits / max((predicted != 0).sum(), 1), hits / max((labels != 0).sum(), 1)
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def test_token_classification_matches_trainer(tmp_path):
    raw = rows("entities.jsonl", 64)
    names = ["O", "B-ANIMAL", "I-ANIMAL", "B-PLACE", "I-PLACE"]
    label2id = {name: i for i, name in enumerate(names)}
    train, evaluation = raw.select(range(48)), raw.select(range(48, 64))
    tokenizer = tokenizer_for([" ".join(words) for words in raw["tokens"]])

    def bert(seed=0):
        torch.manual_seed(seed)
        return transformers.BertForTokenClassification(transformers.BertConfig(
            vocab_size=len(tokenizer), num_labels=len(names), pad_token_id=tokenizer.pad_token_id, **BERT))

    # string tags mapped with train.label2id; the task named, as a run file would
    run = engine_run(tmp_path, bert(), tokenizer, train, evaluation,
                     train_keys={"task": "token-classification", "label2id": label2id, "learning_rate": 1e-2})
    ours = run.predict(evaluation)

    def tokenize_and_align_labels(examples):  # run_ner.py's, label_all_tokens = False
        tokenized_inputs = tokenizer(examples["tokens"], padding=False, truncation=True, max_length=24,
                                     is_split_into_words=True)
        labels = []
        for i, label in enumerate(examples["tags"]):
            word_ids = tokenized_inputs.word_ids(batch_index=i)
            previous_word_idx = None
            label_ids = []
            for word_idx in word_ids:
                if word_idx is None:
                    label_ids.append(-100)
                elif word_idx != previous_word_idx:
                    label_ids.append(label2id[label[word_idx]])
                else:
                    label_ids.append(-100)
                previous_word_idx = word_idx
            labels.append(label_ids)
        tokenized_inputs["labels"] = labels
        return tokenized_inputs

    reference = [d.map(tokenize_and_align_labels, batched=True, remove_columns=d.column_names)
                 for d in (train, evaluation)]
    assert [row["labels"] for row in run.train_dataset] == reference[0]["labels"]
    trainer = transformers.Trainer(model=bert(), args=trainer_args(tmp_path, learning_rate=1e-2),
                                   train_dataset=reference[0],
                                   data_collator=transformers.DataCollatorForTokenClassification(tokenizer))
    trainer.train()
    theirs = trainer.predict(reference[1])
    assert_same_losses(run, trainer)
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)
    np.testing.assert_allclose(ours.predictions, theirs.predictions, atol=1e-5)
    ours_f1, theirs_f1 = token_f1(ours.predictions, ours.label_ids), token_f1(theirs.predictions, theirs.label_ids)
    assert ours_f1 == theirs_f1 and ours_f1 > 0
    # the engine's eval loss is the mean over every labelled token; Trainer's the mean of the batches' means
    token_mean = torch.nn.functional.cross_entropy(torch.tensor(theirs.predictions).flatten(0, 1),
                                                   torch.tensor(theirs.label_ids).flatten())
    assert ours.metrics["test_loss"] == pytest.approx(token_mean.item(), abs=1e-5)


def test_seq2seq_matches_seq2seq_trainer_with_generated_ids(tmp_path):
    raw = rows("reversals.jsonl", 48)
    train, evaluation = raw.select(range(40)), raw.select(range(40, 48))
    tokenizer = tokenizer_for(list(raw["source"]) + list(raw["target"]), eos_after_each=True)  # eos as T5's tokenizer adds it
    generation = {"predict_with_generate": True, "generation_max_length": 12, "generation_num_beams": 2}

    def t5(seed=0):
        torch.manual_seed(seed)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, **T5))

    seen = []

    def keep(prediction):  # compute_metrics receives the generated ids
        seen.append(prediction.predictions)
        return {"width": float(prediction.predictions.shape[1])}

    run = engine_run(tmp_path, t5(), tokenizer, train, evaluation, train_keys=generation, compute_metrics=keep)
    assert run.task == "seq2seq"
    ours = run.predict(evaluation)
    evaluated = run.evaluate()

    def preprocess_function(examples):  # run_summarization.py's, without a prefix
        model_inputs = tokenizer(examples["source"], max_length=24, padding=False, truncation=True)
        labels = tokenizer(text_target=examples["target"], max_length=24, padding=False, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    reference = [d.map(preprocess_function, batched=True, remove_columns=d.column_names) for d in (train, evaluation)]
    model = t5()
    trainer = transformers.Seq2SeqTrainer(
        model=model, args=trainer_args(tmp_path, transformers.Seq2SeqTrainingArguments, **generation),
        train_dataset=reference[0], processing_class=tokenizer,
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, model=model))
    trainer.train()
    theirs = trainer.predict(reference[1])
    assert_same_losses(run, trainer)
    assert ours.predictions.dtype.kind == "i" and ours.predictions.shape == (8, 20)  # padded as Seq2SeqTrainer pads
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    np.testing.assert_array_equal(seen[-1], theirs.predictions)
    assert ours.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], abs=1e-5)
    assert evaluated["eval_width"] == 20 and evaluated["eval_loss"] == ours.metrics["test_loss"]


# ---------------------------------------------------------------------------- run files


def test_each_example_run_file_plans_trains_and_loads_with_its_auto_class(tmp_path, monkeypatch, capfd):
    from engine.cli import main

    monkeypatch.chdir(ROOT)  # the run files name their data and configs from the repository root
    expected = {"sequence_classification": (transformers.AutoModelForSequenceClassification, "eval_accuracy"),
                "token_classification": (transformers.AutoModelForTokenClassification, "eval_f1"),
                "seq2seq": (transformers.AutoModelForSeq2SeqLM, "eval_exact_match")}
    for name, (auto_class, metric) in expected.items():
        path = EXAMPLES / f"{name}.toml"
        assert main(["plan", str(path)]) == 0
        assert f'task = "{name.replace("_", "-")}"' in capfd.readouterr().out.replace("seq2seq", "seq2seq")
        out = tmp_path / name
        assert main(["train", str(path), "--set", f"train.output_dir={out}", "--set", "train.max_steps=2",
                     "--set", "train.eval_steps=2", "--set", "train.save_steps=2", "--set", "train.disable_tqdm=true",
                     "--set", "train.generation_max_length=6" if name == "seq2seq" else "train.seed=42"]) == 0
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert any(metric in entry for entry in logged) and any("eval_loss" in entry for entry in logged)
        model = auto_class.from_pretrained(out)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        inputs = tokenizer(["great day"], return_tensors="pt")
        if name == "seq2seq":
            assert model.generate(**inputs, max_length=5).shape[0] == 1
        else:
            assert model(**inputs).logits.shape[-1] == model.config.num_labels
    classifier = transformers.AutoConfig.from_pretrained(tmp_path / "sequence_classification")
    tagger = transformers.AutoConfig.from_pretrained(tmp_path / "token_classification")
    assert classifier.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    assert tagger.id2label[3] == "B-PLACE" and tagger.num_labels == 5


# ---------------------------------------------------------------------------- resume


def test_classification_and_seq2seq_resume_exactly(tmp_path):
    sentiment = rows("sentiment.jsonl", 40)
    tokenizer = tokenizer_for(sentiment["text"])

    def bert(seed):
        torch.manual_seed(seed)  # dropout on: the resumed run's RNG must be restored too
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=len(tokenizer), num_labels=3, pad_token_id=tokenizer.pad_token_id, **{
                **BERT, "hidden_dropout_prob": 0.1, "max_position_embeddings": 128}))  # data.max_length 128

    evaluated = {"eval_strategy": "steps", "eval_steps": 2}
    check = assert_resume_is_exact(4, 2, tmp_path / "classifier", make_model=bert, dataset=sentiment,
                                   eval_dataset=sentiment.select(range(8)), tokenizer=tokenizer, data_collator=None,
                                   compute_metrics=accuracy, train=evaluated)
    assert any("eval_accuracy" in entry for entry in check.resumed.state.log_history)

    reversals = rows("reversals.jsonl", 24)
    tokenizer = tokenizer_for(list(reversals["source"]) + list(reversals["target"]))

    def t5(seed):
        torch.manual_seed(seed)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, **T5))

    def width(prediction):
        return {"generated_width": float(prediction.predictions.shape[1])}

    check = assert_resume_is_exact(4, 2, tmp_path / "seq2seq", make_model=t5, dataset=reversals,
                                   eval_dataset=reversals.select(range(4)), tokenizer=tokenizer, data_collator=None,
                                   compute_metrics=width, train={**evaluated, "predict_with_generate": True,
                                                                 "generation_config": {"max_length": 6}})
    assert check.resumed.task == "seq2seq"
    assert [e["eval_generated_width"] for e in check.resumed.state.log_history if "eval_loss" in e] == [6.0, 6.0]


# ---------------------------------------------------------------------------- bad input


TAGS = {"O": 0, "B-PLACE": 1, "I-PLACE": 2, "B-ANIMAL": 3, "I-ANIMAL": 4}


def test_bad_task_inputs_are_one_line_exit_2_before_training(tmp_path, monkeypatch, capfd):
    from engine.cli import main
    from engine.config import to_toml

    monkeypatch.chdir(ROOT)
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": f"day {i}"}) + "\n" for i in range(16)))
    (tmp_path / "sources.jsonl").write_text("".join(json.dumps({"source": f"day {i}"}) + "\n" for i in range(16)))
    sentiment = (EXAMPLES / "data" / "sentiment.jsonl").read_text().splitlines()[:16]
    (tmp_path / "null_label.jsonl").write_text("\n".join(sentiment[:4] + ['{"text": "a day", "label": null}'] +
                                                         sentiment[4:]) + "\n")
    (tmp_path / "null_target.jsonl").write_text("".join(json.dumps({"source": f"day {i}", "target": f"night {i}"})
                                                        + "\n" for i in range(6)) + '{"source": "day", "target": null}\n')
    entities = (EXAMPLES / "data" / "entities.jsonl").read_text().splitlines()[:16]
    (tmp_path / "untagged.jsonl").write_text("\n".join(entities[:2] + ["", json.dumps(
        {"tokens": ["a", "day"], "tags": ["O", "NOPE"]})] + entities[2:]) + "\n")
    bert, t5 = "examples/configs/bert-tiny.json", "examples/configs/t5-tiny.json"
    cases = [
        ({"task": "sequence-classification", "model": bert, "num_labels": 2}, "examples/data/sentiment.jsonl",
         "data.train: label 2 is outside the model's 2 classes (0 to 1); set train.num_labels or id2label"),
        ({"task": "sequence-classification", "model": bert}, str(tmp_path / "texts.jsonl"),
         ("data.label_column: data.train has no label column 'label' or 'labels' for sequence-classification; "
          "its columns: text")),
        ({"task": "seq2seq", "model": t5}, str(tmp_path / "sources.jsonl"),
         "data.target_column: data.train has no column 'target' for seq2seq; its columns: source"),
        ({"task": "sequence-classification", "model": bert, "predict_with_generate": True},
         "examples/data/sentiment.jsonl",
         "train.predict_with_generate: a sequence-classification model cannot generate"),
        ({"model": "tiny-llama", "predict_with_generate": True, "task": "token-classification"},
         "examples/data/entities.jsonl", "train.predict_with_generate: a token-classification model cannot generate"),
        # a bad row named by its line in the file
        ({"task": "sequence-classification", "model": bert}, str(tmp_path / "null_label.jsonl"),
         f"data.train: {tmp_path / 'null_label.jsonl'} line 5: label column 'label' is missing or null, expected a "
         "class id or name"),
        ({"task": "seq2seq", "model": t5}, str(tmp_path / "null_target.jsonl"),
         f"data.train: {tmp_path / 'null_target.jsonl'} line 7: 'target' is missing or null, expected a string"),
        ({"task": "token-classification", "model": bert, "label2id": TAGS}, str(tmp_path / "untagged.jsonl"),
         f"data.train: {tmp_path / 'untagged.jsonl'} line 4: label 'NOPE' is not in train.label2id ({', '.join(TAGS)})"),
    ]
    for index, (train, data, message) in enumerate(cases):
        out = tmp_path / f"out{index}"
        path = tmp_path / f"run{index}.toml"
        path.write_text(to_toml({"train": {**train, "output_dir": str(out), "max_steps": 2},
                                 "data": {"train": data, "tokenizer": "train", "tokenizer_vocab_size": 300,
                                          "max_length": 16}}))
        assert main(["train", str(path)]) == 2, message
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("engine: error: " + message), err
        assert not (out / "metrics.jsonl").exists()


def test_a_model_that_cannot_generate_is_refused_and_a_python_classifier_trains_on_scalar_labels(tmp_path):
    """The issue's first case: a 3-label BertForSequenceClassification given in Python, rows of input_ids,
    attention_mask and a scalar label, the default collator."""
    data = [{"input_ids": list(range(1 + i % 5, 9)), "attention_mask": [1] * (8 - i % 5), "labels": i % 3}
            for i in range(16)]

    def bert():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(transformers.BertConfig(vocab_size=32, num_labels=3,
                                                                                   **BERT))

    config = {"train": {"max_steps": 2, "per_device_train_batch_size": 4, "output_dir": str(tmp_path),
                        "save_strategy": "no", "disable_tqdm": True}, "data": {"max_length": 16}}
    run = engine.Run(config, model=bert(), train_dataset=data)
    run.train()
    assert run.task == "sequence-classification" and run.state.global_step == 2
    with pytest.raises(engine.ConfigError, match=r"^train\.predict_with_generate: a sequence-classification model "
                                                 r"cannot generate"):
        engine.Run({**config, "train": {**config["train"], "predict_with_generate": True}}, model=bert())
    with pytest.raises(engine.ConfigError, match=r"^train\.task = 'seq2seq', but the model given is a "
                                                 r"BertForSequenceClassification \(sequence-classification\)"):
        engine.Run({**config, "train": {**config["train"], "task": "seq2seq"}}, model=bert())


def test_class_names_come_from_a_classlabel_column(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(ROOT)
    names, tags = ["bad", "good"], ["O", "B-X", "I-X"]
    rows_ = datasets.Dataset.from_list([{"text": f"day {i}", "label": i % 2, "tokens": ["day", str(i)],
                                         "tags": [0, 1 + i % 2]} for i in range(8)])
    features = rows_.features.copy()
    features["label"] = datasets.ClassLabel(names=names)
    features["tags"] = datasets.List(datasets.ClassLabel(names=tags))
    rows_ = rows_.cast(features)
    for task, expected in (("sequence-classification", names), ("token-classification", tags)):
        run = engine.Run({"train": {"task": task, "model": "examples/configs/bert-tiny.json", "max_steps": 1,
                                    "output_dir": str(tmp_path / task)},
                          "data": {"tokenizer": "train", "tokenizer_vocab_size": 300, "max_length": 8}},
                         train_dataset=rows_)
        run.setup()
        assert run.model.config.id2label == dict(enumerate(expected)), task
        assert run.model.config.label2id == {name: i for i, name in enumerate(expected)}


def test_causal_lm_predict_with_generate_matches_seq2seq_trainer(tmp_path):
    """A causal LM generates from the batch's input_ids (the prompt comes back in front), as Seq2SeqTrainer does."""
    from engine.testing import tiny_dataset, tiny_model

    data = tiny_dataset(size=6, seq_len=8)
    generation = {"predict_with_generate": True, "generation_max_length": 12, "generation_num_beams": 2}
    run = engine.Run({"train": {"max_steps": 1, "output_dir": str(tmp_path / "engine"), "per_device_eval_batch_size": 4,
                                "per_device_train_batch_size": 2,
                                **generation}}, model=tiny_model(pad_token_id=0), train_dataset=data)
    ours = run.predict(data)
    assert run.task == "causal-lm"
    trainer = transformers.Seq2SeqTrainer(
        model=tiny_model(pad_token_id=0), data_collator=transformers.default_data_collator,
        args=transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True,
                                                   per_device_eval_batch_size=4, **generation))
    theirs = trainer.predict(data)
    assert ours.predictions.shape == (6, 20)  # 12 generated, padded to the generation config's 20 as Trainer pads
    np.testing.assert_array_equal(ours.predictions[:, :8], data.rows.numpy())
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    model = tiny_model(pad_token_id=0).eval()
    with torch.no_grad():  # the loss is still computed: the mean over every predicted token
        loss = model(input_ids=data.rows, labels=data.rows).loss.item()
    assert ours.metrics["test_loss"] == pytest.approx(loss, abs=1e-6)


def test_a_sequence_classifier_without_a_pad_token_id_gets_the_tokenizers_as_trainer_users_set_it(tmp_path):
    """Llama configs have no pad_token_id, without which transformers' sequence classifiers refuse batches
    of 2 or more: the engine takes the tokenizer's, as Trainer users set it themselves (same losses)."""
    raw = rows("sentiment.jsonl", 64)
    train, evaluation = raw.select(range(48)), raw.select(range(48, 64))
    tokenizer = tokenizer_for(raw["text"])

    def llama():
        torch.manual_seed(0)
        return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
            vocab_size=len(tokenizer), num_labels=3, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))

    assert llama().config.pad_token_id is None
    run = engine_run(tmp_path, llama(), tokenizer, train, evaluation)
    assert run.model.config.pad_token_id == tokenizer.pad_token_id

    reference = llama()
    reference.config.pad_token_id = tokenizer.pad_token_id  # what a Trainer user writes

    def preprocess(examples):  # run_glue.py's preprocess_function
        return {**tokenizer(examples["text"], padding=False, max_length=24, truncation=True), "label": examples["label"]}

    trainer = transformers.Trainer(model=reference, args=trainer_args(tmp_path),
                                   train_dataset=train.map(preprocess, batched=True, remove_columns=train.column_names),
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    assert_same_losses(run, trainer)

    # the builtin tiny-llama as a classifier, from a run file's keys: it used to fail before reading the data
    built = engine.Run({"train": {"task": "sequence-classification", "model": "tiny-llama", "max_steps": 2,
                                  "per_device_train_batch_size": 4, "output_dir": str(tmp_path / "built"),
                                  "save_strategy": "no", "save_final_model": False, "disable_tqdm": True},
                        "data": {"train": str(EXAMPLES / "data" / "sentiment.jsonl"), "tokenizer": "train",
                                 "tokenizer_vocab_size": 300, "max_length": 16}})
    built.train()
    assert built.model.config.pad_token_id == built.tokenizer.pad_token_id is not None

    unpadded = tokenizer_for(raw["text"])
    unpadded.pad_token = None
    with pytest.raises(engine.ConfigError, match="the model's config has no pad_token_id, which sequence "
                                                 "classification needs .* and the tokenizer has no pad token"):
        engine_run(tmp_path / "unpadded", llama(), unpadded, train, evaluation)
