#!/usr/bin/env bash
# Quick start on a fresh machine (only Python 3.10+ and pip needed):
#   ./dev.sh run     set up .venv and run the embedded default training run
#   ./dev.sh test    set up .venv and run the test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

setup() {
    local stamp="$VENV/.engine-installed"
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt contrib/lion/pyproject.toml ]; then
        return
    fi
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q -e '.[test]' -e contrib/lion
    touch "$stamp"
}

case "${1:-}" in
    setup) setup ;;
    run) setup; shift; "$VENV/bin/engine" train "$@" ;;
    test) setup; shift; "$PY" -m pytest tests contrib "$@" ;;
    *) echo "usage: ./dev.sh setup|run|test [args]" >&2; exit 2 ;;
esac
