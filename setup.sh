#!/usr/bin/env bash
# Creates .venv with everything hybridserve needs (runtime, tests, benchmarks).
# Idempotent: re-running only installs what is missing.
#
# The container image (manifests/Containerfile) runs this same step into its own Python:
#   HYBRIDSERVE_PYTHON  install into this interpreter instead of creating .venv
#   HYBRIDSERVE_EXTRAS  optional dependency groups (default: test,bench)
set -euo pipefail
cd "$(dirname "$0")"
EXTRAS=${HYBRIDSERVE_EXTRAS-test,bench}
TARGET=${HYBRIDSERVE_PYTHON:-}
if [ -z "$TARGET" ]; then
  PYTHON=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
  fi
  TARGET=.venv/bin/python
fi
PIP=("$TARGET" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned, so that no later dependency resolution can pick a CUDA build.
"${PIP[@]}" -c requirements/constraints.txt torch
"${PIP[@]}" -c requirements/constraints.txt -e ".${EXTRAS:+[$EXTRAS]}"
