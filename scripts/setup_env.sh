#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment .venv and installs jaxrlvr into it.
#
# Usage: scripts/setup_env.sh [EXTRA]   EXTRA: "test" installs the test extra (pytest, torch CPU, TRL for `jaxrlvr bench loop`, ...).
# Prints the venv's python on the last line. pip's own chatter (build-backend notices, index
# warnings) goes to .venv/install.log; it is shown only when the install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_BIN="${PYTHON:-python3}"
VENV="${JAXRLVR_VENV:-.venv}"
EXTRA="${1:-}"
TARGET="."
[ -n "$EXTRA" ] && TARGET=".[$EXTRA]"
LOG="$VENV/install.log"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV and installing jaxrlvr (a few minutes the first time)" >&2
  "$PYTHON_BIN" -m venv "$VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >"$LOG" 2>&1 || true
fi
if ! "$VENV/bin/python" -m pip install --quiet -e "$TARGET" >>"$LOG" 2>&1; then
  echo "installing jaxrlvr failed; the last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
echo "$VENV/bin/python"
