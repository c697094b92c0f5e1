#!/usr/bin/env bash
# Set everything up (a venv in .venv with meshnode and its test extra), run the checks (lint, format,
# types, import layers), then the whole suite.
# Multi-host tests need root (network namespaces); without root they are skipped with a reason.
# The suite runs in three parallel workers (pytest-xdist), a whole test module to a worker so that
# a module's fixtures are made once; MESHNODE_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-venv.sh "[test]"
export TMPDIR=${TMPDIR:-/tmp}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy's cache outside the clone: a fresh clone's check then reads what an earlier one found
# (mypy checks each file's hash against it), a few seconds instead of about twenty
MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/meshnode/mypy} .venv/bin/mypy meshnode
.venv/bin/lint-imports
# Tests marked quiet time the machine itself: they run afterwards, with nothing beside them.
# pytest's exit status 5 (nothing selected, e.g. a file without quiet tests) counts as a pass.
status=0
.venv/bin/python -m pytest -q -ra -n "${MESHNODE_TEST_WORKERS:-3}" --dist loadscope --no-loadscope-reorder \
  -m "not quiet" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
# Without arguments, only the files that hold quiet tests are collected again (seconds saved).
if [ "$#" -eq 0 ]; then
  set -- $(grep -l "mark\.quiet" tests/test_*.py)
fi
quiet=0
.venv/bin/python -m pytest -q -ra -m quiet "$@" || quiet=$?
[ "$quiet" -eq 5 ] && quiet=0
exit $(( status > quiet ? status : quiet ))
