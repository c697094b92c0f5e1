#!/usr/bin/env bash
# Set everything up (a venv in .venv with meshnode and its test extra), run the checks (lint, format,
# types, import layers), then the whole suite.
# Multi-host tests need root (network namespaces); without root they are skipped with a reason.
# The suite runs in MESHNODE_TEST_WORKERS parallel workers (pytest-xdist), a whole test module to a
# worker so that a module's fixtures are made once; `-n 0` after the script runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-venv.sh "[test]"
export TMPDIR=${TMPDIR:-/tmp}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy meshnode
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q -ra -n "${MESHNODE_TEST_WORKERS:-3}" --dist loadscope "$@"
