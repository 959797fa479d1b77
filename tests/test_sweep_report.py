"""`engine report SWEEP_DIR`: the report of a sweep folder, from three tiny real trial runs, a real
Optuna study told their objectives, and the sweep.json `engine sweep` writes beside them."""

import json
import re

import pytest
from PIL import Image

from engine import cli
from engine.builtin.report_writer import RunFiles, _fmt, figures
from engine.testing import run_steps, tiny_dataset
from engine.tooling.sweep_report import write_sweep_report

optuna = pytest.importorskip("optuna")
pytest.importorskip("matplotlib")

SPACE = {"train.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
         "train.warmup_steps": {"type": "int", "low": 0, "high": 4, "log": False}}
# three trials that train, one the sweep runs now (no folder yet), one that failed and whose folder is gone
PARAMS = [{"train.learning_rate": rate, "train.warmup_steps": warmup}
          for rate, warmup in ((3e-3, 0), (3e-2, 2), (1e-4, 1), (1e-2, 3), (5e-2, 4))]
STATES = ["finished", "finished", "finished", "running", "failed"]
STEPS = 6


def _records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _train(folder, params):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ENGINE_REPORT", "off")  # the trial's own end-of-run report is not under test
        run_steps(STEPS, output_dir=folder, eval_dataset=tiny_dataset(8, seed=1),
                  train={"eval_strategy": "steps", "eval_steps": 2, "learning_rate": params["train.learning_rate"],
                         "warmup_steps": params["train.warmup_steps"]})
    return [row["eval_loss"] for row in _records(folder) if "eval_loss" in row][-1], STEPS


def _sweep(folder, trained, objective=None, directions=("minimize",)):
    """sweep.json and study.db as `engine sweep` leaves them: ``trained`` maps a trial number to its
    objective value(s) and last step."""
    storage = f"sqlite:///{folder / 'study.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name="sweep", directions=list(directions))
    trials = []
    for number, (params, status) in enumerate(zip(PARAMS, STATES)):
        study.enqueue_trial(params)
        trial = study.ask()
        trial.suggest_float("train.learning_rate", 1e-4, 1e-1, log=True)
        trial.suggest_int("train.warmup_steps", 0, 4)
        value, step = trained.get(number, (None, 0))
        if status == "finished":
            study.tell(trial, value)
        elif status == "failed":
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        trials.append({"number": number, "folder": f"trial-{number}", "params": params, "status": status,
                       "objective": value, "step": step, "duration_s": 1.5 + number if status != "running" else None})
    settings = {"kind": "engine sweep", "backend": "optuna", "run_file": "run.toml", "space": SPACE,
                "objective": objective, "directions": list(directions), "sampler": "tpe", "seed": 3,
                "pruner": {"type": "median", "n_warmup_steps": 2}, "n_trials": 8, "study": "sweep",
                "storage": storage, "trials": trials, "best": [trial.number for trial in study.best_trials]}
    (folder / "sweep.json").write_text(json.dumps(settings), encoding="utf-8")
    return settings


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    trained = {number: _train(folder / f"trial-{number}", PARAMS[number]) for number in range(3)}
    _sweep(folder, trained)
    return folder


@pytest.fixture(scope="module")
def report(sweep_dir):
    write_sweep_report(sweep_dir)
    return (sweep_dir / "report.md").read_text()


def _section(text, name):
    return text.split(f"## {name}\n")[1].split("\n## ")[0]


def _table(section):
    """The rows of the first markdown table in ``section``, its header first (the separator left out)."""
    lines = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in section.splitlines()
             if line.startswith("| ")]
    return lines[:1] + lines[2:]


def _objectives(folder):
    settings = json.loads((folder / "sweep.json").read_text())
    return {trial["number"]: trial["objective"] for trial in settings["trials"]}


def test_the_trials_side_by_side_best_first_and_marked(sweep_dir, report):
    objectives = _objectives(sweep_dir)
    finished = sorted(range(3), key=lambda number: objectives[number])
    assert re.findall(r"^## (.+)$", report, re.M) == ["The sweep", "Trials", "The study", "Top trials", "Curves"]
    assert "- trials: 5 of 8: 3 finished, 0 pruned, 1 failed, 1 running" in report
    assert "- objective: Trainer's default objective (eval_loss; the sum of the metrics with compute_metrics), " \
           "minimize" in report
    assert f"- best: trial-{finished[0]} (objective {objectives[finished[0]]:.6g}); `engine train " \
           f"{sweep_dir / f'trial-{finished[0]}'}/run.toml --set train.output_dir=NEW` repeats it" in report
    assert "- sampler: tpe (seed 3); pruner: median (n_warmup_steps=2)" in report
    header, *rows = _table(_section(report, "Trials"))
    assert header == ["best", "trial", "folder", "train.learning_rate", "train.warmup_steps", "objective", "status",
                      "step", "duration"]
    expected = [["★" if number == finished[0] else "", str(number), f"trial-{number}",
                 _fmt(PARAMS[number]["train.learning_rate"]), str(PARAMS[number]["train.warmup_steps"]),
                 f"{objectives[number]:.6g}", "finished", str(STEPS), f"{1.5 + number:.1f} s"] for number in finished]
    expected += [["", "3", "trial-3", "0.01", "3", "-", "running", "0", "-"],
                 ["", "4", "trial-4", "0.05", "4", "-", "failed", "0", "5.5 s"]]
    assert rows == expected
    assert "Not in " in report and "(moved or deleted?): `trial-4/`; their rows are from `sweep.json`." in report


def test_optunas_plots_are_pngs_beside_the_report(sweep_dir, report):
    for name, title in (("history", "optimization history"), ("importances", "parameter importances")):
        assert f"![{title}](report-{name}.png)" in _section(report, "The study")
        image = Image.open(sweep_dir / f"report-{name}.png")
        image.verify()
        assert Image.open(sweep_dir / f"report-{name}.png").size == (800, 450)
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir / 'study.db'}")
    importances = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    assert _table(_section(report, "The study")) == [["parameter", "importance"],
                                                     *([key, _fmt(value)] for key, value in importances.items())]
    assert sum(importances.values()) == pytest.approx(1.0)
    html = (sweep_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(re.findall(r"!\[", report))  # every image inline


def test_the_top_trials_curves_overlaid(sweep_dir, report):
    from engine.tooling.sweep_report import SweepFiles

    objectives = _objectives(sweep_dir)
    top = [f"trial-{number}" for number in sorted(range(3), key=lambda number: objectives[number])]
    assert f"The curves of the best 3 finished trial(s): {', '.join(top)}." in report
    runs, unread = SweepFiles.read(sweep_dir).top_runs()
    assert [run.name for run in runs] == top and unread == []
    loss = figures(runs)["loss"].axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in loss.get_lines()}
    for name in top:  # each trial's own logged values, labelled with its folder
        records = _records(sweep_dir / name)
        assert lines[f"{name}: loss"] == [row["loss"] for row in records if "loss" in row]
        assert lines[f"{name}: eval_loss"] == [row["eval_loss"] for row in records if "eval_loss" in row]
    for name in ("loss", "eval"):
        assert f"](report-{name}.png)" in _section(report, "Curves")
        Image.open(sweep_dir / f"report-{name}.png").verify()


def test_several_objectives_draw_the_pareto_front(sweep_dir, tmp_path):
    folder = tmp_path / "pareto"
    folder.mkdir()
    trained = {}
    for number in range(3):  # the same trial runs, two objectives: eval_loss and the last training loss
        (folder / f"trial-{number}").symlink_to(sweep_dir / f"trial-{number}")
        run = RunFiles.read(folder / f"trial-{number}")
        trained[number] = ([run.eval_rows[-1]["eval_loss"], run.train_rows[-1]["loss"]], STEPS)
    settings = _sweep(folder, trained, objective=["eval_loss", "loss"], directions=("minimize", "minimize"))
    write_sweep_report(folder, size=(640, 360))
    text = (folder / "report.md").read_text()
    assert "- objective: eval_loss (minimize), loss (minimize)" in text
    assert "![Pareto front](report-pareto.png)" in text and not (folder / "report-history.png").exists()
    assert Image.open(folder / "report-pareto.png").size == (640, 360)
    assert "No parameter importances: they are computed for a study with one objective." in text
    rows = _table(_section(text, "Trials"))[1:]
    marked = {int(row[1]) for row in rows if row[0] == "★"}
    assert marked == set(settings["best"]) and marked
    assert [row[5:7] for row in rows if row[1] == "0"] == [[f"{value:.6g}" for value in trained[0][0]]]


def test_the_command_writes_it_and_refuses_a_damaged_sweep_json(sweep_dir, tmp_path, capfd):
    out = tmp_path / "out"
    assert cli.main(["report", str(sweep_dir), "--out", str(out), "--no-plots"]) == 0
    assert f"wrote {out / 'report.md'}" in capfd.readouterr().out
    text = (out / "report.md").read_text()
    assert "Plots are off (--no-plots)" in text and "| ★ |" in text and not list(out.glob("*.png"))

    assert cli.main(["report", str(sweep_dir), str(sweep_dir / "trial-0")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"report: {sweep_dir} is a sweep folder (sweep.json): report it alone" in err[0]

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "sweep.json").write_text('{"kind": "engine sweep", "trials": [', encoding="utf-8")
    assert cli.main(["report", str(damaged)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"engine: error: report: {damaged / 'sweep.json'} is not valid JSON")
    (damaged / "sweep.json").write_text('{"trials": [{"number": "0"}]}', encoding="utf-8")
    assert cli.main(["report", str(damaged)]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        f"engine: error: report: {damaged / 'sweep.json'} trials[0]: number is string \"0\", expected integer "
        "(a damaged or edited file?)"]


def test_what_cannot_be_read_is_a_line_of_the_report(sweep_dir, tmp_path):
    folder = tmp_path / "moved"  # sweep.json alone: the trial folders and the study left behind
    folder.mkdir()
    (folder / "sweep.json").write_text((sweep_dir / "sweep.json").read_text(), encoding="utf-8")
    (folder / "study.db").write_text("not a database", encoding="utf-8")
    write_sweep_report(folder)
    text = (folder / "report.md").read_text()
    assert f"No Optuna plots: cannot read the study in `{folder / 'study.db'}`: (sqlite3.DatabaseError) file is " \
           "not a database" in text
    assert "(moved or deleted?): `trial-0/`, `trial-1/`, `trial-2/`, `trial-4/`;" in text
    assert "No curves: no top trial could be read." in text
    assert f"- report: {folder / 'trial-0'} is not a folder, so there is nothing to report" in text
    assert "## Curves" not in text and not list(folder.glob("*.png"))
    assert len(_table(_section(text, "Trials"))) == 1 + len(PARAMS)  # the rows, from sweep.json
