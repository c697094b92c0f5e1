#!/usr/bin/env bash
# Set everything up (a venv in .venv with meshnode and its test extra), run the checks (lint, format,
# types, import layers), then the whole suite.
# Multi-host tests need root (network namespaces); without root they are skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-venv.sh "[test]"
export TMPDIR=${TMPDIR:-/tmp}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy meshnode
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q -ra "$@"
