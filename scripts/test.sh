#!/usr/bin/env bash
# The README's second command: install jaxrlvr with its test extra, install the CPU build of vLLM
# into its own environment (cached at ~/.cache/jaxrlvr/vllm-venv), and run the whole test suite,
# real-vLLM and slow tests included. Extra arguments are passed to pytest
# (e.g. `scripts/test.sh -m "not slow and not vllm"` for the quick everyday run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup_env.sh test | tail -n1)
if [ -z "${JAXRLVR_VLLM_PYTHON:-}" ] && [ "${JAXRLVR_SKIP_VLLM_SETUP:-0}" != "1" ]; then
  JAXRLVR_VLLM_PYTHON=$(scripts/setup_vllm.sh | tail -n1)
  export JAXRLVR_VLLM_PYTHON
fi
# Two workers (JAXRLVR_TEST_WORKERS; 0 runs in one process): whole test modules per worker, every
# vLLM module together on one (the scheduler: tests/conftest.py). On 2 cores this took the suite's
# algos folder from 773 s to 546 s.
exec "$PY" -m pytest -q -n "${JAXRLVR_TEST_WORKERS:-2}" "$@"
