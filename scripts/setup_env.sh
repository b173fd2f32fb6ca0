#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment .venv and installs jaxrlvr into it.
#
# Usage: scripts/setup_env.sh [EXTRA]   EXTRA: "test" installs the test extra (pytest, torch CPU, ...).
# Prints the venv's python on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_BIN="${PYTHON:-python3}"
VENV="${JAXRLVR_VENV:-.venv}"
EXTRA="${1:-}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON_BIN" -m venv "$VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
fi
if [ -n "$EXTRA" ]; then
  "$VENV/bin/python" -m pip install --quiet -e ".[$EXTRA]" >&2
else
  "$VENV/bin/python" -m pip install --quiet -e . >&2
fi
echo "$VENV/bin/python"
