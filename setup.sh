#!/usr/bin/env bash
# Creates .venv with everything hybridserve needs (runtime, tests, benchmarks).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first, pinned, so that no later dependency resolution can pick a CUDA build.
"${PIP[@]}" -c requirements/constraints.txt torch
"${PIP[@]}" -c requirements/constraints.txt -e ".[test,bench]"
