#!/usr/bin/env bash
# The README's first command: install jaxrlvr and run the embedded default job (configs/demo.yaml):
# a tiny Qwen2 trained from scratch on the synthetic arithmetic task, SFT warm start then GRPO with
# the embedded JAX sampler, on the CPU. Extra arguments are passed to `jaxrlvr train`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup_env.sh | tail -n1)
exec "$(dirname "$PY")/jaxrlvr" train configs/demo.yaml "$@"
