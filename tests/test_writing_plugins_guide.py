"""docs/writing-plugins.md: its hook table lists every hook, its links resolve, and its complete
plugins and test run as written."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import hookimpl
from engine.errors import ConfigError
from engine.hookspecs import HOOK_NAMES, combine_kind
from engine.testing import run_steps, same_weights, tiny_model, write_run_file

ROOT = Path(__file__).resolve().parents[1]
GUIDE_PATH = ROOT / "docs" / "writing-plugins.md"
GUIDE = GUIDE_PATH.read_text()


def _block(lang: str, after: str, first_line: str | None = None) -> str:
    """The first ```lang block after the heading ``after`` (whose first line is ``first_line``, if given)."""
    start = GUIDE.index(after)
    for match in re.finditer(rf"```{lang}\n(.*?)```", GUIDE[start:], re.S):
        if first_line is None or match.group(1).startswith(first_line):
            return match.group(1)
    raise AssertionError(f"no ```{lang} block after {after!r}")


def _import(tmp_path: Path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ---------------------------------------------------------------------------- the hook table


def test_the_hook_table_lists_every_hook_with_its_combine_kind_and_anchor():
    rows = re.findall(r"^\| \[`(\w+)`\]\(hooks\.md#(\w+)\) \| ([a-z ]+?) \| ([a-z ]+?) \|", GUIDE, re.M)
    listed = [name for name, _, _, _ in rows]
    assert sorted(listed) == sorted(HOOK_NAMES), f"missing: {set(HOOK_NAMES) - set(listed)}; " \
                                                 f"not hooks: {set(listed) - set(HOOK_NAMES)}"
    hooks_md = (ROOT / "docs" / "hooks.md").read_text()
    for name, anchor, kind, _area in rows:
        assert anchor == name
        assert f'<a id="{name}"></a>' in hooks_md, f"docs/hooks.md has no anchor {name!r}"
        assert kind == combine_kind(name), (name, kind)


def test_links_resolve():
    headings = {_slug(line.lstrip("#")) for line in GUIDE.splitlines() if line.startswith("#")}
    for target in re.findall(r"\]\(([^)\s]+)\)", GUIDE):
        path, _, anchor = target.partition("#")
        if path.startswith("http"):
            continue
        if path:
            assert (GUIDE_PATH.parent / path).exists(), target
        elif anchor:
            assert anchor in headings, target


def test_the_readme_links_the_guide():
    assert "(docs/writing-plugins.md)" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------- the complete plugins


def test_the_freeze_plugin_works_as_written(entry_point_plugin, site_dir, tmp_path):
    source = _block("python", "## From zero", "# engine_freeze/__init__.py")
    entry_point_plugin("freeze", source)
    run = run_steps(3, plugins=["freeze"], output_dir=tmp_path / "run", sections={"freeze": {"patterns": ["embed"]}})
    changed = same_weights(run.model, tiny_model())
    assert changed and not any("embed" in name for name in changed)
    assert all(p.requires_grad for p in run.model.parameters())  # undone at the end
    with pytest.raises(ConfigError, match=r"^freeze\.patterns\[1\]: '\(' is not a regex"):
        run_steps(1, plugins=["freeze"], output_dir=tmp_path / "bad", sections={"freeze": {"patterns": ["x", "("]}})
    with pytest.raises(ConfigError, match=r"^freeze\.patterns: \['nothing'\] match no trainable parameter"):
        run_steps(1, plugins=["freeze"], output_dir=tmp_path / "none", sections={"freeze": {"patterns": ["nothing"]}})

    # the guide's command lines compose with the plugin installed (checked with `engine plan`)
    write_run_file(tmp_path, [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), os.environ.get("PYTHONPATH", "")])}
    lines = [line.split("#")[0] for line in _block("bash", "## From zero").splitlines() if line.startswith("engine ")]
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        result = subprocess.run([sys.executable, "-m", "engine", "plan", *words[2:]], cwd=tmp_path, env=env,
                                capture_output=True, text=True)
        assert result.returncode == 0, (line, result.stderr)
        assert re.search(r"patch_model\s+broadcast\s+freeze", result.stdout)


class Crash:
    """Raises in on_step_end of ``at_step`` (None: never); in every compared run, as resume requires."""

    name = "crash"

    def __init__(self, at_step=None):
        self.at_step = at_step

    @hookimpl
    def on_step_end(self, run):
        if run.state.global_step == self.at_step:
            raise RuntimeError("crash")


def test_the_ema_plugin_works_and_resumes_as_written(tmp_path):
    module = _import(tmp_path, "engine_guide_ema", _block("python", "## Checkpointed state", "# engine_ema/"))
    assert 'ema = "engine_ema:EMA"' in _block("toml", "## Checkpointed state")

    def train(name, decay, crash_at=None, resume=False):
        return run_steps(8, objects=[module.EMA(), Crash(crash_at)], output_dir=tmp_path / name,
                         sections={"ema": {"decay": decay}},
                         train={"save_strategy": "steps", "save_steps": 4, "resume_from_checkpoint": resume or None})

    latest = train("latest", 0.0)  # keep nothing of the old average: the average is the last weights
    average = torch.load(tmp_path / "latest" / "ema.pt")
    assert all(torch.equal(average[name], p) for name, p in latest.model.named_parameters())

    whole = train("whole", 0.5)
    with pytest.raises(RuntimeError, match="crash"):
        train("resumed", 0.5, crash_at=6)
    train("resumed", 0.5, resume=True)
    expected, found = (torch.load(tmp_path / name / "ema.pt") for name in ("whole", "resumed"))
    assert expected.keys() == found.keys() and all(torch.equal(expected[k], found[k]) for k in expected)
    assert not all(torch.equal(expected[name], p) for name, p in whole.model.named_parameters())


def test_the_testing_example_runs_as_written(tmp_path):
    module = _import(tmp_path, "guide_csv_test", _block("python", "## Testing with", "# tests/test_csv_tracker.py"))
    module.test_the_csv_holds_what_metrics_jsonl_holds(tmp_path / "run")


def test_the_check_example_is_what_the_check_prints(tmp_path):
    shown = _block("console", "## Tools", "$ engine plugins --check engine_gradclip.py")
    (tmp_path / "engine_gradclip.py").write_text(
        "from engine import hookimpl\n\n\n@hookimpl\ndef compute_loss(run, model, batch, num_items):\n    return None\n")
    result = subprocess.run([sys.executable, "-m", "engine", "plugins", "--check", "engine_gradclip.py"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stdout == shown.split("\n", 1)[1]


def test_the_optimizer_family_example_registers_checks_and_builds(tmp_path):
    module = _import(tmp_path, "adams", _block("python", "### Optimizer families"))
    run = run_steps(2, objects=[module], output_dir=tmp_path / "run", train={"optim": "radam", "adam_beta2": 0.95,
                                                                           "optim_args": "decoupled_weight_decay=true"})
    assert type(run.optimizer) is torch.optim.RAdam and run.registries["optimizer"].get("radam").plugin == "adams"
    group = run.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["decoupled_weight_decay"] is True
    from engine import Run

    with pytest.raises(ConfigError, match=r"^train.optim_args: nadam takes decoupled_weight_decay; got 'lr'; set "
                                          r"train.learning_rate$"):
        Run({"train": {"optim": "nadam", "optim_args": "lr=0.1"}}, plugins=[module])
