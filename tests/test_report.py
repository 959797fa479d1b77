"""Reports: report.md / report.html / report-*.png at the end of a run and from `engine report`,
for one run and for several compared; one tiny run's output_dir is shared by the tests."""

import base64
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from engine import cli
from engine.config import to_toml
from engine.builtin.report_writer import RunFiles, figures, write_report
from engine.testing import run_steps, tiny_dataset, tiny_model, tiny_tokenizer

CURVES = ["loss", "eval", "learning_rate", "grad_norm"]


def _run(out, report="full", **train):
    previous = os.environ.get("ENGINE_REPORT")
    os.environ["ENGINE_REPORT"] = report  # the suite's conftest turns the end-of-run report off
    try:
        return run_steps(6, ["samples"], output_dir=out, model=tiny_model(vocab_size=300), tokenizer=tiny_tokenizer(),
                         eval_dataset=tiny_dataset(8, seed=1),
                         sections={"samples": {"prompts": ["record 2: the", "fox"], "max_new_tokens": 4}},
                         train={"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
                                "metric_for_best_model": "loss", "load_best_model_at_end": True, **train})
    finally:
        os.environ["ENGINE_REPORT"] = previous if previous is not None else "off"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "a"
    _run(out)
    return out


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _sections(text):
    return re.findall(r"^## (.+)$", text, re.M)


def test_the_end_of_a_run_writes_each_section_and_its_curves(run_dir):
    text = (run_dir / "report.md").read_text()
    assert _sections(text) == ["The run", "Final metrics", "Evaluations", "Best checkpoint", "Samples", "Curves"]
    assert "- status: finished" in text and "- plugins: samples (engine 0.1.0)" in text
    assert "| train.max_steps | -1 | 6 |" in text and "| samples.max_new_tokens | 32 | 4 |" in text
    assert "| train.seed |" not in text  # only what differs from the defaults
    evaluations = [r for r in _records(run_dir) if "eval_loss" in r]
    best = min(evaluations, key=lambda r: r["eval_loss"])
    assert f"- step {best['step']}: eval_loss = {best['eval_loss']:.4g}, the lowest of 3 evaluation(s), by " \
           "train.metric_for_best_model" in text
    assert f"- its checkpoint: `checkpoint-{best['step']}/`" in text
    assert "train.load_best_model_at_end: the final model in output_dir holds these weights" in text
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    first = {r["prompt"]: r["completion"] for r in samples if r["step"] == 2}
    last = {r["prompt"]: r["completion"] for r in samples if r["step"] == 6}
    assert "| prompt | step 2 | step 6 |" in text
    cell = lambda completion: completion.replace("|", "\\|")  # noqa: E731 (escaped in a markdown table)
    assert f"| fox | {cell(first['fox'])} | {cell(last['fox'])} |" in text
    for name in CURVES:
        assert f"](report-{name}.png)" in text
        image = Image.open(run_dir / f"report-{name}.png")
        image.verify()  # a valid PNG
        image = Image.open(run_dir / f"report-{name}.png").convert("L")
        assert image.size == (800, 450)
        assert ImageStat.Stat(image).stddev[0] > 10  # lines and text, not a blank canvas


def test_the_curves_hold_the_logged_values(run_dir):
    records = _records(run_dir)
    drawn = figures([RunFiles.read(run_dir)])
    lines = {line.get_label(): line for axes in drawn["loss"].axes for line in axes.lines}
    assert list(lines) == ["loss", "eval_loss"]
    assert lines["loss"].get_xdata().tolist() == [r["step"] for r in records if "loss" in r]
    assert lines["loss"].get_ydata().tolist() == [r["loss"] for r in records if "loss" in r]
    assert lines["eval_loss"].get_ydata().tolist() == [r["eval_loss"] for r in records if "eval_loss" in r]
    assert "rewards" not in drawn  # preference plugins' curve (plugins/dpo/tests): no such metrics here
    (rate,) = drawn["learning_rate"].axes[0].lines
    assert rate.get_ydata().tolist() == [r["learning_rate"] for r in records if "learning_rate" in r]


def test_the_html_report_is_self_contained(run_dir):
    page = (run_dir / "report.html").read_text()
    images = re.findall(r'<img alt="[^"]+" src="data:image/png;base64,([^"]+)">', page)
    assert [base64.b64decode(data) for data in images] == [(run_dir / f"report-{n}.png").read_bytes() for n in CURVES]
    assert "report-" not in page.replace("Run report", "")  # no file it would need beside it
    assert [h for h in re.findall(r"<h2>(.+?)</h2>", page)] == _sections((run_dir / "report.md").read_text())


def test_engine_report_compares_runs_side_by_side(run_dir, tmp_path, capfd):
    other = tmp_path / "b"
    _run(other, report="text", learning_rate=3e-3)  # ENGINE_REPORT=text: no curves at its end
    assert not list(other.glob("*.png"))
    assert "Curves are off (ENGINE_REPORT=text); `engine report " in (other / "report.md").read_text()
    assert cli.main(["report", str(run_dir), str(other), "--out", str(tmp_path / "both"), "--size", "640x360"]) == 0
    assert "wrote" in capfd.readouterr().out
    text = (tmp_path / "both" / "report.md").read_text()
    assert _sections(text) == ["Runs", "Config keys that differ", "Final metrics", "Best checkpoints", "Curves"]
    differing = re.findall(r"^\| (train\.\S+) \|", text.split("## Config keys that differ")[1].split("##")[0], re.M)
    assert differing == ["train.output_dir", "train.learning_rate"]
    assert "| train.learning_rate | 0.01 | 0.003 |" in text
    final_a, final_b = _records(run_dir)[-1], _records(other)[-1]
    assert f"| train_loss | {final_a['train_loss']:.4g} | {final_b['train_loss']:.4g} |" in text
    assert Image.open(tmp_path / "both" / "report-loss.png").size == (640, 360)
    drawn = figures([RunFiles.read(run_dir), RunFiles.read(other)])
    assert [line.get_label() for line in drawn["loss"].axes[0].lines] == [
        "a: loss", "a: eval_loss", "b: loss", "b: eval_loss"]  # one set of axes, both runs


def test_without_matplotlib_the_report_says_how_to_get_curves(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    write_report([run_dir], tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "pip install 'engine[report]'" in text and "![" not in text


def test_a_folder_without_metrics_is_one_line_and_exit_status_2(tmp_path, capfd):
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"engine: error: report: {tmp_path / 'empty'} has no metrics.jsonl, so there is nothing to "
                   "report (give a run's train.output_dir; a run writes metrics.jsonl from its first log step)"]
    assert cli.main(["report", str(tmp_path), "--size", "big"]) == 2
    assert "--size: expected WIDTHxHEIGHT" in capfd.readouterr().err


def test_the_report_says_why_a_run_stopped_early_or_diverged(tmp_path):
    from engine.errors import TrainingDiverged

    os.environ["ENGINE_REPORT"] = "text"
    try:
        # patience 1 and an improvement threshold no evaluation reaches: stops after the 2nd evaluation
        run_steps(10, ["early_stopping"], output_dir=tmp_path / "stopped", eval_dataset=tiny_dataset(8, seed=1),
                  sections={"early_stopping": {"patience": 1, "threshold": 100.0}},
                  train={"eval_strategy": "steps", "eval_steps": 2, "metric_for_best_model": "loss"})
        with pytest.raises(TrainingDiverged):
            run_steps(10, output_dir=tmp_path / "diverged", train={"learning_rate": 1e9, "max_grad_norm": 0.0})
    finally:
        os.environ["ENGINE_REPORT"] = "off"
    stopped = (tmp_path / "stopped" / "report.md").read_text()
    assert "Stopped at step 4 of 10: early_stopping: eval_loss did not improve for 1 evaluation(s) in a row." \
        in stopped
    diverged = (tmp_path / "diverged" / "report.md").read_text()
    assert "- status: failed" in diverged and "The run diverged (a nan or inf loss or gradient norm)" in diverged
    assert cli.main(["report", str(tmp_path / "diverged"), "--no-plots"]) == 0  # run.json now says diverged
    assert "- status: diverged" in (tmp_path / "diverged" / "report.md").read_text()


# ---------------------------------------------------------------------------- malformed input: one line each


def _report(capfd, *argv):
    """``engine report ARGV`` in-process: (exit status, the lines on stderr)."""
    capfd.readouterr()
    status = cli.main(["report", *map(str, argv)])
    return status, [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def _append(path, text):
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


# (case, how the copy of a run's folder is damaged, the file and what the line says)
DAMAGED = [
    ("a row that is not an object", lambda d: _append(d / "metrics.jsonl", "[1, 2]\n"),
     "metrics.jsonl line {next} holds a JSON list, expected an object"),
    ("a binary metrics.jsonl", lambda d: (d / "metrics.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff"),
     "metrics.jsonl is not UTF-8 text (byte 0x89 on line 1); a damaged file?"),
    ("a string step", lambda d: _append(d / "metrics.jsonl", '{"step": "3", "loss": 1.0}\n'),
     'metrics.jsonl line {next}: step is string "3", expected integer'),
    ("a row without a step", lambda d: _append(d / "metrics.jsonl", '{"loss": 1.0}\n'),
     "metrics.jsonl line {next}: step is missing, expected integer"),
    ("a broken line before the last", lambda d: _append(d / "metrics.jsonl", '{"step": 3, "lo\n{"step": 4}\n'),
     "metrics.jsonl line {next} is not JSON: Unterminated string"),
    ("hyperparams.json holding a list", lambda d: (d / "hyperparams.json").write_text("[1, 2]"),
     "hyperparams.json holds a JSON list, expected an object"),
    ("a max_steps that is a string", lambda d: (d / "hyperparams.json").write_text('{"train": {"max_steps": "6"}}'),
     'hyperparams.json: train.max_steps is string "6", expected integer'),
    ("plugins that are not names", lambda d: (d / "hyperparams.json").write_text('{"plugins": [1]}'),
     "hyperparams.json: plugins is list [1], expected list of string"),
    ("run.json not JSON", lambda d: (d / "run.json").write_text("{oops"), "run.json is not valid JSON: "),
    ("run.json not UTF-8", lambda d: (d / "run.json").write_bytes(b'{"status": "\xff"}'),
     "run.json is not UTF-8 text (byte 0xff on line 1)"),
    ("a sample whose prompt is a number", lambda d: _append(d / "samples.jsonl",
                                                            '{"step": 6, "prompt": 5, "completion": "x"}\n'),
     "samples.jsonl line {next_sample}: prompt is integer 5, expected string or list of object"),
]


@pytest.mark.parametrize("name, damage, fragment", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_a_damaged_file_is_one_line_naming_the_file_and_line(run_dir, tmp_path, capfd, name, damage, fragment):
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    for report in folder.glob("report*"):
        report.unlink()
    lines = {"next": len(_records(run_dir)) + 1,
             "next_sample": len((run_dir / "samples.jsonl").read_text().splitlines()) + 1}
    damage(folder)
    status, err = _report(capfd, folder, "--no-plots")
    assert status == 2 and len(err) == 1, err
    file_name = fragment.split()[0].rstrip(":")
    assert err[0].startswith(f"engine: error: report: {folder / file_name}"), err[0]
    assert fragment.format(**lines) in err[0], err[0]
    assert not list(folder.glob("report*"))


def test_a_last_line_cut_short_by_a_kill_is_left_out(run_dir, tmp_path, capfd):
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    _append(folder / "metrics.jsonl", '{"step": 7, "lo')  # no newline: the write a kill interrupted
    status, err = _report(capfd, folder, "--no-plots")
    assert status == 0, err
    assert RunFiles.read(folder).last_step == 6


@pytest.mark.parametrize("argv, fragment", [
    (["--size", "100000x100000"], "--size: expected WIDTHxHEIGHT in pixels, each from 100 to 4000 (e.g. 800x450), got "
                                  "'100000x100000'"),
    (["--size", "1" + "0" * 5000 + "x100"], "--size: expected WIDTHxHEIGHT in pixels, each from 100 to 4000 "
                                            "(e.g. 800x450), got '1000000000000000000000000000000000000...'"),
    (["--out", "afile"], "report: --out afile is a file, not a folder; give a folder (made if missing)"),
    (["--out", "/sys/engine-report"], "report: cannot create /sys/engine-report: "),
])
def test_a_bad_size_or_out_is_one_line(run_dir, tmp_path, capfd, monkeypatch, argv, fragment):
    if argv[1].startswith("/sys") and not Path("/sys").is_dir():
        pytest.skip("no /sys here to be refused by")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine")
    status, err = _report(capfd, run_dir, "--no-plots", *argv)
    assert status == 2 and len(err) == 1 and err[0].startswith(f"engine: error: {fragment}"), err
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_run_refused_before_its_first_step_prints_only_its_error(tmp_path, capfd, monkeypatch):
    """The evaluation at the start fails: log_finish runs (trackers close their runs), but the report
    has nothing to say and says nothing; the error is the only line."""
    monkeypatch.setenv("ENGINE_REPORT", "text")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of a small corpus" for i in range(200)))
    (tmp_path / "metrics_code.py").write_text("def broken(prediction):\n    return prediction.nothing\n")
    (tmp_path / "run.toml").write_text(to_toml({
        "train": {"max_steps": 2, "disable_tqdm": True, "save_strategy": "no", "output_dir": "out",
                  "model_config": {"hidden_size": 32, "intermediate_size": 64}, "eval_on_start": True,
                  "compute_metrics": "metrics_code:broken"},
        "data": {"train": "corpus.txt", "eval_split": 0.1, "max_length": 16, "tokenizer": "train",
                 "tokenizer_vocab_size": 300}}))
    capfd.readouterr()
    assert cli.main(["train", "run.toml"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert err == ["engine: error: train.compute_metrics: metrics_code:broken raised AttributeError: "
                   "'EvalPrediction' object has no attribute 'nothing'"], err
    assert not list((tmp_path / "out").glob("report*"))
