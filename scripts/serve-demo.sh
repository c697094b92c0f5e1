#!/usr/bin/env bash
# Set everything up (a venv in .venv with meshnode) and start a node serving the built-in demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-venv.sh
exec .venv/bin/meshnode run "$@"
