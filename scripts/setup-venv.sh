#!/usr/bin/env bash
# Create .venv (if missing) and install meshnode into it, editable, with the extras given ("" or "[test]").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${1:-}"
