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
# The code reward's sandbox (reward.fn: code) runs programs under bubblewrap: install it when
# missing and we are root with apt (CI, containers); otherwise say how, once, and go on.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing bubblewrap (the code reward's sandbox)" >&2
    mkdir -p "$VENV"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap \
        || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; }; \
      } >>"$VENV/apt.log" 2>&1; then
      echo "installing bubblewrap failed (see $VENV/apt.log); reward.fn: code needs it" >&2
    fi
  else
    echo "note: bubblewrap ('bwrap') is not installed; reward.fn: code needs it (apt-get install bubblewrap)" >&2
  fi
fi
if ! "$VENV/bin/python" -m pip install --quiet -e "$TARGET" >>"$LOG" 2>&1; then
  echo "installing jaxrlvr failed; the last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
echo "$VENV/bin/python"
