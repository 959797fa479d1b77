"""The console: tqdm bars under a real pseudo-terminal, plain log lines when output is a file."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from engine.testing import write_run_file


def _run_file(tmp_path):
    path = write_run_file(tmp_path, [], max_steps=12, logging_steps=4, save_steps=100, disable_tqdm=False,
                          eval_strategy="steps", eval_steps=8)
    path.write_text(path.read_text().replace("[data]\n", "[data]\neval_split = 0.1\n"))
    return path


def _in_pty(argv, timeout=300):
    """Run ``argv`` with stdin/stdout/stderr on a 120x40 pseudo-terminal; returns what the screen got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    screen = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    process.wait(timeout=timeout)
    os.close(master)
    return process.returncode, screen.decode(errors="replace")


def test_bars_on_a_terminal_with_rate_time_left_and_intact_log_lines(tmp_path):
    run_file = _run_file(tmp_path)
    status, screen = _in_pty([sys.executable, "-m", "engine", "train", str(run_file)])
    assert status == 0, screen[-3000:]
    draws = [part for part in re.split(r"[\r\n]", screen) if part.startswith("train:")]
    assert any(re.search(r"\| 12/12 \[\d\d:\d\d<00:00, +[\d.]+(step/s|s/step), loss=[\d.]+, lr=", d) for d in draws)
    assert any(re.search(r"\[\d\d:\d\d<\d\d:\d\d", d) for d in draws)  # time left
    assert any(part.startswith("eval:") for part in re.split(r"[\r\n]", screen))  # the evaluation bar
    # each log line whole on its own line, not broken by a redraw
    logged = re.findall(r"\rstep (\d+): loss=[\d.]+ learning_rate=\S+ grad_norm=\S+ tokens_per_second=\S+ "
                        r"step_time=\S+ epoch=\S+\r\n", screen)
    assert logged == ["4", "8", "12"], screen[-3000:]


def test_no_bar_and_no_carriage_return_into_files(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine", "train", str(_run_file(tmp_path))], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr and "step/s" not in result.stderr
    assert [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("step")] == [
        "step 4", "step 8", "step 8", "step 12", "step 12"]  # evaluation at 8; the train summary


def test_on_prediction_step_counts_the_batches_of_each_pass(tmp_path):
    from engine import hookimpl
    from engine.testing import run_steps, tiny_dataset

    calls = []

    class Recorder:
        name = "recorder"

        @hookimpl
        def on_prediction_step(self, run, step, total):
            calls.append((step, total))

    run = run_steps(2, objects=[Recorder()], output_dir=tmp_path, eval_dataset=tiny_dataset(size=10, seed=1),
                    train={"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 4})
    assert calls == [(1, 3), (2, 3), (3, 3)]  # 10 rows in batches of 4
    run.predict(tiny_dataset(size=4, seed=2))
    assert calls[3:] == [(1, 1)]


def test_the_bar_starts_again_with_the_new_step_count_after_an_auto_find_batch_size_restart(tmp_path):
    # batch 8 runs out of memory at its first step; 7 fits: 64 rows are 10 steps an epoch instead of 8
    script = tmp_path / "restart.py"
    script.write_text(f"""
import torch
from engine import hookimpl
from engine.testing import run_steps

class OutOfMemoryAbove7:
    @hookimpl
    def patch_model(self, run, model):
        def check(module, args, kwargs):
            if kwargs["input_ids"].shape[0] > 7:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return model.register_forward_pre_hook(check, with_kwargs=True).remove

run = run_steps(-1, objects=[OutOfMemoryAbove7()], output_dir={str(tmp_path / "out")!r},
                train={{"num_train_epochs": 1, "per_device_train_batch_size": 8, "auto_find_batch_size": True,
                        "disable_tqdm": False, "save_strategy": "no", "logging_steps": 100}})
assert run.config.train.per_device_train_batch_size == 7
""")
    status, screen = _in_pty([sys.executable, str(script)])
    assert status == 0, screen[-3000:]
    draws = [part for part in re.split(r"[\r\n]", screen) if part.startswith("train:")]
    assert any("| 10/10 [" in d for d in draws), screen[-3000:]
    assert not any(re.search(r"\| \d+/8 \[", d) for d in draws[-3:]), draws[-3:]  # not the first attempt's total
