#!/usr/bin/env bash
# Quick start on a fresh machine (only Python 3.10+ and pip needed):
#   ./dev.sh run     set up .venv and run the embedded default training run (afresh each time)
#   ./dev.sh test    set up .venv and run the test suite (what CI runs)
#   ./dev.sh wheels [PLUGIN ...]  build wheels of engine, every plugin (or those named) and all
#                    their dependencies into wheelhouse/ (scripts/wheelhouse.py), so that
#                    pip install --no-index --find-links wheelhouse 'engine[galore,liger]' works offline
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PLUGINS=(plugins/*/)
CONTRIB=(contrib/*/)  # third-party-style plugins, each its own distribution

install() {
    "$PY" -m pip install --upgrade pip &&
    # the CPU build of torch first (constraints.txt pins it): an unpinned torch would pull a
    # multi-GB CUDA build
    "$PY" -m pip install -c constraints.txt torch &&
    # deepspeed (for plugins/deepspeed) builds against the installed torch, so without build
    # isolation, and compiles no ops now (DS_BUILD_OPS=0): the one it needs on CPU is built below
    DS_BUILD_OPS=0 "$PY" -m pip install --no-build-isolation -c constraints.txt deepspeed &&
    "$PY" -m pip install -c constraints.txt "$@" &&
    # DeepSpeed JIT-compiles its shared-memory op on first use on CPU (~1 min); compile it once
    # into the venv, where the deepspeed tests point TORCH_EXTENSIONS_DIR
    TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" "$PY" -c 'from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
builder is None or builder.load()'
}

setup() {
    local stamp="$VENV/.engine-installed"
    if [ -f "$stamp" ] && [ -z "$(find constraints.txt pyproject.toml contrib/*/pyproject.toml plugins/*/pyproject.toml -newer "$stamp")" ]; then
        return
    fi
    python3 -m venv "$VENV"
    local editables=(-e '.[test]')
    for plugin in "${PLUGINS[@]}" "${CONTRIB[@]}"; do editables+=(-e "$plugin"); done
    local log="$VENV/setup.log"  # pip's and setuptools' chatter: shown only when the install fails
    echo "engine: installing into $VENV (log: $log)" >&2
    if ! install "${editables[@]}" > "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "engine: setup failed; the whole log is $log" >&2
        exit 1
    fi
    touch "$stamp"
}

case "${1:-}" in
    setup) setup ;;
    # the demo starts afresh each time; a plain `engine train` refuses to overwrite another run
    run) setup; shift; "$VENV/bin/engine" train --set train.overwrite_output_dir=true "$@" ;;
    # two workers, a test file each (the 25 slowest tests listed: CI has a time budget); then the tests marked
    # "alone" (the offline wheelhouse) by themselves.
    # With arguments: pytest with those arguments, in one process
    test) setup; shift
        if [ $# -gt 0 ]; then exec "$PY" -m pytest "$@"; fi
        "$PY" -m pytest -n 2 --dist loadfile --durations=25 -m "not alone" tests contrib plugins
        "$PY" -m pytest -m alone tests contrib plugins ;;
    wheels) setup; shift; "$PY" scripts/wheelhouse.py "$@" ;;
    *) echo "usage: ./dev.sh setup|run|test|wheels [args]" >&2; exit 2 ;;
esac
