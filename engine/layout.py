"""The names of what the engine writes into ``output_dir`` (no imports: the CLI reads it early).

::

    output_dir/
        run.lock                flock(2)-ed by the main process for the run's life; its PID inside
        run.json                the run record: run id, config fingerprint, versions, status, starts
        metrics.jsonl           one JSON object per log event
        samples.jsonl           generated text (the samples plugin): one row per prompt and step
        report.md, report.html  what the run did (engine.report), with its curves report-*.png
        hyperparams.json        the composed config
        checkpoint-<step>/      a checkpoint; its manifest checkpoint_complete (written last)
                                names the run that wrote it and each file's size and xxh3-64 checksum
        config.json, model.safetensors, tokenizer files, ...
        model_complete          the final model's manifest, likewise written last
        .tmp-*, .deleting-*     saves and deletions in flight (removed when the next run starts)
"""

LOCK = "run.lock"
RECORD = "run.json"
METRICS = "metrics.jsonl"
HYPERPARAMS = "hyperparams.json"
SAMPLES = "samples.jsonl"
REPORT = "report.md"
REPORT_HTML = "report.html"
# the report's curves, report-<name>.png
CURVES = ("loss", "eval", "learning_rate", "grad_norm", "rewards")  # rewards: preference plugins (dpo)
PREFIX = "checkpoint-"
TMP = ".tmp-"
DELETING = ".deleting-"
MARKER = "checkpoint_complete"
FINAL_MARKER = "model_complete"
FINAL_TMP = TMP + "final-model"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Top-level files that mean "a model lives here", with or without the engine's manifest.
MODEL_FILES = ("config.json", WEIGHTS, WEIGHTS_INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json",
               "adapter_config.json")
# Files besides the final model that belong to the run recorded in the folder.
RUN_FILES = (METRICS, HYPERPARAMS, RECORD, SAMPLES, REPORT, REPORT_HTML, *(f"report-{name}.png" for name in CURVES))
