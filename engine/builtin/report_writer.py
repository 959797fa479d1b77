"""Reports: what a run did and which checkpoint to adopt, from the files it left in output_dir.

The builtin ``report`` plugin when a run ends (and ``engine report OUTPUT_DIR``) writes
``report.md`` with its curves as ``report-<name>.png`` beside it, and the same content as one
self-contained ``report.html`` (the images inline), from ``run.json``, ``hyperparams.json``,
``metrics.jsonl``, ``samples.jsonl`` and the checkpoint folders:

* the run: status, id, versions, plugins, the config keys that differ from the defaults;
* final and best metrics; the table of evaluations;
* the best checkpoint and why (``metric_for_best_model``, early stopping, divergence);
* the first and the last samples side by side;
* curves: loss, evaluation metrics, learning rate, gradient norm, preference rewards (matplotlib, Agg backend,
  through the extra ``report``; without it the report says how to get them).

With several output dirs (``engine report a b --out DIR``) the curves of every run share one
set of axes, and tables set side by side the config keys that differ and the final metrics.
"""

from __future__ import annotations

import base64
import html
import json
import math
import typing
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.errors import ConfigError
from engine.layout import CURVES, HYPERPARAMS, METRICS, PREFIX, RECORD, REPORT, REPORT_HTML, SAMPLES
from engine.util import decode_utf8

DEFAULT_SIZE = (800, 450)  # pixels of each curve
# what the report reads of each file, and the kinds it can use
METRICS_TYPES = {"step": int}
SAMPLES_TYPES = {"step": int, "prompt": (str, list[dict]), "completion": str}
HYPERPARAMS_TYPES = {"plugins": list[str], "train": dict, "train.max_steps": int, "train.metric_for_best_model": str,
                     "train.greater_is_better": bool, "early_stopping": dict}
RECORD_TYPES = {"status": str, "run_id": str, "starts": list, "versions": dict, "versions.plugins": dict,
                "switched_off": (dict, list[str])}
# evaluation metrics that time the evaluation rather than judge the model
TIMING = ("_runtime", "_samples_per_second", "_steps_per_second")
CURVE_TITLES = {"loss": "loss", "eval": "evaluation metrics", "learning_rate": "learning rate",
                "grad_norm": "gradient norm", "rewards": "reward margins and accuracies (preference tuning)"}
NO_PLOTS = ("Curves need matplotlib, which is not installed here: `pip install 'engine[report]'` (or "
            "`pip install matplotlib`), then `engine report {dirs}` draws them.")


def _read_text(path: Path) -> str | None:
    """The text of one of the run's files; None when it is not there."""
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"report: cannot read {path}: {exc.strerror}") from None
    return decode_utf8(data, f"report: {path}", fix="a damaged file?")


def _json_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", int: "integer", bool: "boolean", float: "number",
            type(None): "null"}.get(value if isinstance(value, type) else type(value), "?")


def _is(value: Any, kind: Any) -> bool:
    """``value`` is of ``kind``: a type (a boolean is no integer), ``list[item kind]`` or a tuple of kinds."""
    if isinstance(kind, tuple):
        return any(_is(value, k) for k in kind)
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_is(item, typing.get_args(kind)[0]) for item in value)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(map(_kind_name, kind))
    if typing.get_origin(kind) is list:
        return f"list of {_kind_name(typing.get_args(kind)[0])}"
    return _json_name(kind)


def _shown(value: Any) -> str:
    """A value as a message shows it: its JSON kind and the start of its JSON text."""
    if value is None:
        return "missing"
    text = json.dumps(value, ensure_ascii=False)
    return f"{_json_name(value)} {text if len(text) <= 40 else text[:37] + '...'}"


def _check_types(data: dict[str, Any], types: dict[str, Any], where: str, required: bool = False) -> None:
    """Refuse a value the report would trip over: ``types`` maps each (dotted) key the report reads
    to the kind it can use; an absent key or null passes unless ``required``."""
    for key, kind in types.items():
        value: Any = data
        for part in key.split("."):  # "train.max_steps": "train" is checked before it
            value = value.get(part) if isinstance(value, dict) else None
        if value is None and not required or _is(value, kind):
            continue
        raise ConfigError(f"report: {where}: {key} is {_shown(value)}, expected {_kind_name(kind)} "
                          "(a damaged or edited file?)")


def _read_jsonl(path: Path, types: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of a JSONL file, each an object with the keys ``types`` requires. A last line
    without its newline that is not JSON was cut short by a kill, and is left out."""
    text = _read_text(path)
    lines = text.split("\n") if text is not None else []
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            if number == len(lines):
                break
            raise ConfigError(f"report: {path} line {number} is not JSON: {exc} (a damaged file?)") from None
        if not isinstance(row, dict):
            raise ConfigError(f"report: {path} line {number} holds a JSON {_json_name(row)}, expected an object "
                              "(a damaged or edited file?)")
        _check_types(row, types, f"{path} line {number}", required=True)
        rows.append(row)
    return rows


def _read_json(path: Path, types: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON object file ({} when it is not there), with the kinds ``types`` names."""
    text = _read_text(path)
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"report: {path} is not valid JSON: {exc} (a damaged file?)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"report: {path} holds a JSON {_json_name(data)}, expected an object "
                          "(a damaged or edited file?)")
    _check_types(data, types or {}, str(path))
    return data


def _is_eval_metric(key: str) -> bool:
    return key.startswith("eval_") and not key.endswith(TIMING)


@dataclass
class RunFiles:
    """One output_dir as the report reads it."""

    folder: Path
    name: str
    metrics: list[dict[str, Any]]
    config: dict[str, Any]
    record: dict[str, Any]
    samples: list[dict[str, Any]]
    checkpoints: list[str]
    adapter: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: str | Path, name: str | None = None) -> RunFiles:
        folder = Path(folder)
        metrics = _read_jsonl(folder / METRICS, METRICS_TYPES)
        if not metrics:
            what = "is not a folder" if not folder.is_dir() else \
                f"has no {METRICS}" if not (folder / METRICS).is_file() else f"has an empty {METRICS}"
            raise ConfigError(f"report: {folder} {what}, so there is nothing to report (give a run's "
                              f"train.output_dir; a run writes {METRICS} from its first log step)")
        checkpoints = sorted((p.name for p in folder.glob(f"{PREFIX}*")
                              if p.name[len(PREFIX):].isdecimal() and p.is_dir()), key=lambda n: int(n[len(PREFIX):]))
        return cls(folder, name or folder.resolve().name, metrics, _read_json(folder / HYPERPARAMS, HYPERPARAMS_TYPES),
                   _read_json(folder / RECORD, RECORD_TYPES), _read_jsonl(folder / SAMPLES, SAMPLES_TYPES),
                   checkpoints, _read_json(folder / "adapter_config.json"))

    @property
    def train(self) -> dict[str, Any]:
        return self.config.get("train", {})

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics if "loss" in r]

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics if any(_is_eval_metric(k) for k in r)]

    @property
    def eval_keys(self) -> list[str]:
        keys: dict[str, None] = {}
        for row in self.eval_rows:
            keys.update((k, None) for k in row if _is_eval_metric(k))
        return list(keys)

    @property
    def last_step(self) -> int:
        return max(r["step"] for r in self.metrics)

    def final_metrics(self) -> dict[str, Any]:
        """The last value of each metric: training (loss, learning rate, ...), evaluation, summary."""
        final: dict[str, Any] = {"step": self.last_step}
        for row in self.metrics:
            final.update((k, v) for k, v in row.items() if k not in ("step", "epoch"))
        return final

    def best(self) -> tuple[str, dict[str, Any], bool] | None:
        """(metric, the evaluation row, greater is better) that is best by ``metric_for_best_model``
        (default eval_loss), as the engine picks it: the first of equal values."""
        rows = self.eval_rows
        if not rows:
            return None
        name = self.train.get("metric_for_best_model") or "loss"
        name = name if name.startswith("eval_") else f"eval_{name}"
        greater = self.train.get("greater_is_better")
        greater = (not name.endswith("loss")) if greater is None else greater
        candidates = [r for r in rows if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
        if not candidates:
            return None
        best_value = (max if greater else min)(r[name] for r in candidates)
        return name, next(r for r in candidates if r[name] == best_value), greater

    def status(self) -> str:
        return self.record.get("status", "unknown (no run.json)")


# ---------------------------------------------------------------------------- config defaults


def _plugin_schema(name: str) -> type | None:
    from engine.errors import EngineError
    from engine.plugins import installed_plugins

    plugin = installed_plugins().get(name)
    if plugin is None:
        return None
    try:
        target = plugin.load()
    except EngineError:
        return None
    options = getattr(target, "plugin_options", None)
    return options() if callable(options) else None


def default_config(plugins: list[str], schemas: dict[str, type | None] | None = None) -> dict[str, Any]:
    """The config a run with ``plugins`` and nothing set has (``schemas``: the plugins' option
    classes, else looked up among the installed plugins; one not installed has no defaults here)."""
    from engine.config import DataConfig, TrainConfig, from_mapping, to_mapping

    defaults: dict[str, Any] = {"train": to_mapping(TrainConfig()), "data": to_mapping(DataConfig())}
    for name in plugins:
        schema = schemas.get(name) if schemas is not None else _plugin_schema(name)
        if schema is not None:
            try:
                defaults[name] = to_mapping(from_mapping(schema, {}, name))
            except ConfigError:  # a required option: no default to compare with
                continue
    return defaults


def _flat(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and not prefix:  # sections; a table value (model_config) stays one
            flat.update(_flat(value, f"{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(config: dict[str, Any], defaults: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, default, value)`` for each config key whose value is not its default (sections of
    plugins without known defaults list every key, default ``?``)."""
    flat, flat_defaults = _flat(config), _flat(defaults)
    return [(key, flat_defaults.get(key, "?"), value) for key, value in flat.items()
            if key != "plugins" and (key not in flat_defaults or flat_defaults[key] != value)]


# ---------------------------------------------------------------------------- figures


def figures(runs: list[RunFiles], size: tuple[int, int] = DEFAULT_SIZE) -> dict[str, Any]:
    """matplotlib Figures by curve name (:data:`~engine.layout.CURVES`), one line per run and metric;
    a curve no run has data for is left out. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure registry
    from matplotlib.ticker import MaxNLocator

    def series(run: RunFiles, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in run.metrics if isinstance(r.get(key), (int, float))]
        return [s for s, _ in points], [v for _, v in points]

    wanted = {"loss": lambda run: ["loss", "eval_loss"], "eval": lambda run: run.eval_keys,
              "learning_rate": lambda run: ["learning_rate"], "grad_norm": lambda run: ["grad_norm"],
              "rewards": lambda run: sorted({key for row in run.metrics for key in row
                                            if key.endswith(("rewards/margins", "rewards/accuracies"))})}
    out = {}
    for name in CURVES:
        lines = []
        for run in runs:
            for key in wanted[name](run):
                steps, values = series(run, key)
                if steps:
                    label = key if len(runs) == 1 else f"{run.name}: {key}"
                    lines.append((label, steps, values, key.startswith("eval_")))
        if not lines:
            continue
        figure = Figure(figsize=(size[0] / 100, size[1] / 100), dpi=100)
        axes = figure.subplots()
        for label, steps, values, is_eval in lines:
            axes.plot(steps, values, label=label, marker="o" if is_eval else None, markersize=4)
        axes.set_title(CURVE_TITLES[name])
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        out[name] = figure
    return out


# ---------------------------------------------------------------------------- the document


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return " / ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
    return str(prompt)


class Document:
    """Blocks rendered both as markdown and as HTML: headings, paragraphs, tables, images."""

    def __init__(self, title: str):
        self.title = title
        self.blocks: list[tuple[str, Any]] = []

    def heading(self, text: str) -> None:
        self.blocks.append(("h2", text))

    def paragraph(self, text: str) -> None:
        self.blocks.append(("p", text))

    def bullets(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", (header, [[_fmt(c) for c in row] for row in rows])))

    def image(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def markdown(self) -> str:
        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", "<br>")

        out = [f"# {self.title}", ""]
        for kind, content in self.blocks:
            if kind == "h2":
                out += [f"## {content}", ""]
            elif kind == "p":
                out += [content, ""]
            elif kind == "ul":
                out += [f"- {item}" for item in content] + [""]
            elif kind == "table":
                header, rows = content
                out.append("| " + " | ".join(map(cell, header)) + " |")
                out.append("|" + " --- |" * len(header))
                out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
                out.append("")
            elif kind == "img":
                path, alt = content
                out += [f"![{alt}]({path.name})", ""]
        return "\n".join(out)

    def html(self) -> str:
        def inline(text: str) -> str:  # the markdown the paragraphs use: `code` only
            parts = html.escape(text).split("`")
            return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))

        out = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8">', f"<title>{html.escape(self.title)}</title>",
               "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em}"
               "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
               "text-align:left;vertical-align:top}code{background:#f4f4f4}img{max-width:100%}</style>",
               "</head><body>", f"<h1>{html.escape(self.title)}</h1>"]
        for kind, content in self.blocks:
            if kind == "h2":
                out.append(f"<h2>{html.escape(content)}</h2>")
            elif kind == "p":
                out.append(f"<p>{inline(content)}</p>")
            elif kind == "ul":
                out.append("<ul>" + "".join(f"<li>{inline(item)}</li>" for item in content) + "</ul>")
            elif kind == "table":
                header, rows = content
                out.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
                out += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
                out.append("</table>")
            elif kind == "img":
                path, alt = content
                data = base64.b64encode(path.read_bytes()).decode("ascii")
                out.append(f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>')
        out.append("</body></html>")
        return "\n".join(out) + "\n"


def _run_section(doc: Document, run: RunFiles, defaults: dict[str, Any]) -> None:
    versions = run.record.get("versions") or {}
    doc.heading("The run")
    starts = run.record.get("starts") or []
    lines = [f"output_dir: `{run.folder}`", f"status: {run.status()}",
             f"steps: {run.last_step} of {run.train.get('max_steps', '?')} (train.max_steps)"]
    if run.record.get("run_id"):
        lines.append(f"run id: `{run.record['run_id']}`" + (f", resumed {len(starts) - 1} time(s)"
                                                             if len(starts) > 1 else ""))
    if versions:
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()
                                              if k != "plugins" and v is not None))
    plugins = versions.get("plugins") or {name: "?" for name in run.config.get("plugins", [])}
    lines.append("plugins: " + (", ".join(f"{k} ({v})" for k, v in plugins.items()) or "none (builtins only)"))
    if run.adapter:
        lines.append(f"adapter: {run.adapter.get('peft_type', '?')} r={run.adapter.get('r', '?')} on "
                     f"`{run.adapter.get('base_model_name_or_path', '?')}` (adapter_config.json)")
    if run.record.get("switched_off"):
        lines.append("switched off after a failure: " + ", ".join(run.record["switched_off"]))
    doc.bullets(lines)
    if run.config:
        differences = config_differences(run.config, defaults)
        doc.paragraph("Config keys that differ from the defaults:" if differences else
                      "The config is the defaults.")
        if differences:
            doc.table(["key", "default", "value"], [list(d) for d in differences])


def _best_section(doc: Document, run: RunFiles) -> None:
    doc.heading("Best checkpoint")
    best = run.best()
    train = run.train
    if best is None:
        doc.paragraph("No evaluation with a finite metric, so no best checkpoint: set train.eval_strategy "
                      "(and data.eval or data.eval_split). The last weights are the final model.")
    else:
        name, row, greater = best
        checkpoint = f"{PREFIX}{row['step']}"
        chosen_by = "train.metric_for_best_model" if train.get("metric_for_best_model") else \
            "eval_loss (no train.metric_for_best_model set)"
        lines = [f"step {row['step']}: {name} = {_fmt(row[name])}, the {'highest' if greater else 'lowest'} of "
                 f"{len(run.eval_rows)} evaluation(s), by {chosen_by}"]
        if checkpoint in run.checkpoints:
            lines.append(f"its checkpoint: `{checkpoint}/`")
        else:
            lines.append(f"no `{checkpoint}/` here: no save at that step, or rotated away (train.save_steps, "
                         "train.save_total_limit)")
        if train.get("load_best_model_at_end"):
            lines.append("train.load_best_model_at_end: the final model in output_dir holds these weights")
        doc.bullets(lines)
    status, max_steps = run.status(), train.get("max_steps", -1)
    last_loss = run.train_rows[-1].get("loss") if run.train_rows else 0.0
    if status == "diverged" or last_loss is None:  # non-finite values are null on disk
        doc.paragraph(f"The run diverged (a nan or inf loss or gradient norm) after step {run.last_step}: "
                      "nothing non-finite was saved; the checkpoints above are from before.")
    elif isinstance(max_steps, int) and 0 < max_steps and run.last_step < max_steps and status == "finished":
        why = "a plugin stopped it"
        if "early_stopping" in run.config.get("plugins", []):
            patience = run.config.get("early_stopping", {}).get("patience", "?")
            why = (f"early_stopping: {best[0] if best else 'the metric'} did not improve for {patience} "
                   "evaluation(s) in a row")
        doc.paragraph(f"Stopped at step {run.last_step} of {max_steps}: {why}.")


def _samples_section(doc: Document, run: RunFiles) -> None:
    if not run.samples:
        return
    doc.heading("Samples")
    steps = sorted({row["step"] for row in run.samples})
    first, last = steps[0], steps[-1]
    by_prompt: dict[str, dict[int, str]] = {}
    for row in run.samples:
        by_prompt.setdefault(_prompt_text(row["prompt"]), {})[row["step"]] = row["completion"]
    doc.paragraph(f"The first and the last generations ({len(steps)} rounds in `{SAMPLES}`).")
    doc.table(["prompt", f"step {first}", f"step {last}"],
              [[prompt, done.get(first), done.get(last)] for prompt, done in by_prompt.items()])


def _curves_section(doc: Document, runs: list[RunFiles], out: Path, size: tuple[int, int], plots: bool,
                    dirs: str) -> list[Path]:
    doc.heading("Curves")
    if not plots:
        doc.paragraph("Curves are off (ENGINE_REPORT=text); `engine report " + dirs + "` draws them.")
        return []
    try:
        drawn = figures(runs, size)
    except ImportError:
        doc.paragraph(NO_PLOTS.format(dirs=dirs))
        return []
    written = []
    for name, figure in drawn.items():
        path = out / f"report-{name}.png"
        _write_file(path, lambda tmp: figure.savefig(tmp, format="png"))
        doc.image(path, CURVE_TITLES[name])
        written.append(path)
    return written


def _write_file(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` a temporary file beside ``path``, then rename it: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except OSError as exc:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"report: cannot write {path}: {exc.strerror or exc}; choose another folder with --out") \
            from None


def _write(out: Path, doc: Document) -> Path:
    for name, text in ((REPORT, doc.markdown()), (REPORT_HTML, doc.html())):
        _write_file(out / name, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out / REPORT


def _make_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"report: --out {out} is a file, not a folder; give a folder (made if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"report: cannot create {out}: {exc.strerror}; choose another folder with --out") from None


def write_report(folders: list[str | Path], out: str | Path | None = None, *, size: tuple[int, int] = DEFAULT_SIZE,
                 plots: bool = True, defaults: dict[str, Any] | None = None, status: str | None = None) -> Path:
    """Write report.md, report.html and report-*.png into ``out`` (default: the one folder) for the
    runs in ``folders``; returns report.md's path. ``defaults``: the default config to compare with
    (one run); ``status``: the run's status when its run.json is not final yet (the end of a run)."""
    runs = [RunFiles.read(folder) for folder in folders]
    names = [run.name for run in runs]
    for index, run in enumerate(runs):  # two folders of one name: tell them apart by position
        if names.count(run.name) > 1:
            run.name = f"{run.name} ({index + 1})"
    if status is not None:
        runs[0].record["status"] = status
    out = Path(out) if out is not None else runs[0].folder
    _make_folder(out)
    dirs = " ".join(str(run.folder) for run in runs)
    if len(runs) == 1:
        run = runs[0]
        doc = Document(f"Run report: {run.name}")
        _run_section(doc, run, defaults if defaults is not None else default_config(run.config.get("plugins", [])))
        _metrics_section(doc, run)
        _best_section(doc, run)
        _samples_section(doc, run)
    else:
        doc = Document("Runs compared: " + ", ".join(run.name for run in runs))
        _comparison(doc, runs)
    _curves_section(doc, runs, out, size, plots, dirs)
    return _write(out, doc)


def _metrics_section(doc: Document, run: RunFiles) -> None:
    doc.heading("Final metrics")
    final = run.final_metrics()
    doc.table(["metric", "value"], [[k, v] for k, v in final.items()])
    doc.heading("Evaluations")
    rows = run.eval_rows
    if not rows:
        doc.paragraph("No evaluations (train.eval_strategy = 'no', or none was due).")
        return
    keys = run.eval_keys
    best = run.best()
    best_step = best[1]["step"] if best else None
    doc.table(["step", "epoch", *keys, "best"],
              [[r["step"], r.get("epoch"), *(r.get(k) for k in keys), "best" if r["step"] == best_step else ""]
               for r in rows])


def _comparison(doc: Document, runs: list[RunFiles]) -> None:
    doc.heading("Runs")
    doc.table(["run", "output_dir", "status", "steps", "plugins"],
              [[run.name, str(run.folder), run.status(), run.last_step,
                ", ".join(run.config.get("plugins", [])) or "-"] for run in runs])
    flats = [_flat(run.config) for run in runs]
    keys = list(dict.fromkeys(k for flat in flats for k in flat))
    differing = [k for k in keys if len({json.dumps(flat.get(k), sort_keys=True) for flat in flats}) > 1]
    doc.heading("Config keys that differ")
    if differing:
        doc.table(["key", *(run.name for run in runs)], [[k, *(flat.get(k) for flat in flats)] for k in differing])
    else:
        doc.paragraph("None: the runs have the same config.")
    doc.heading("Final metrics")
    finals = [run.final_metrics() for run in runs]
    metrics = list(dict.fromkeys(k for final in finals for k in final))
    doc.table(["metric", *(run.name for run in runs)], [[m, *(final.get(m) for final in finals)] for m in metrics])
    doc.heading("Best checkpoints")
    lines = []
    for run in runs:
        best = run.best()
        lines.append(f"{run.name}: " + (f"step {best[1]['step']}, {best[0]} = {_fmt(best[1][best[0]])}"
                                        if best else "no evaluation"))
    doc.bullets(lines)

