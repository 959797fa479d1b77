#!/usr/bin/env bash
# The GPU check in one command, from a clean checkout on a machine with a CUDA GPU:
#   bash benchmarks/gpu_check.sh [--only throughput,liger,...] [--out DIR]
# sets up $VENV (default .venv; reused when present) with torch 2.13.0 from PyPI (its default Linux wheel is
# the CUDA build), the engine and the plugins the check trains with (liger, peft with bitsandbytes, bnb, ddp,
# fsdp; accelerate, for Trainer, is an engine dependency), then runs benchmarks/gpu_check.py with the
# arguments given. Not ./dev.sh setup: that installs every plugin, deepspeed and the test extras (trl, ray,
# the trackers' clients), minutes a short GPU window has no room for; like it, pip's chatter goes to a log
# shown only when the install fails, and constraints.txt pins the versions.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"

install() {
    "$PY" -m pip install --upgrade pip &&
    # a venv made by ./dev.sh holds torch's CPU build (2.13.0+cpu, which "torch==2.13.0" accepts): replaced
    if "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is None)' 2>/dev/null; then :; else
        "$PY" -m pip uninstall -y torch
    fi &&
    "$PY" -m pip install -c constraints.txt torch==2.13.0 -e . -e plugins/liger -e 'plugins/peft[quantize]' \
        -e plugins/bnb -e plugins/ddp -e plugins/fsdp
}

log="$VENV/gpu-check-setup.log"
echo "gpu_check: installing into $VENV (log: $log)" >&2
if ! install > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "gpu_check: setup failed; the whole log is $log" >&2
    exit 1
fi
if ! "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is None)'; then
    echo "gpu_check: pip installed a CPU build of torch (+cpu wheels on its index?): only --device cpu can run" >&2
fi
exec "$PY" benchmarks/gpu_check.py "$@"
