#!/usr/bin/env bash
# Set everything up (a venv in .venv with meshnode) and start a node serving the built-in demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
exec .venv/bin/meshnode run "$@"
