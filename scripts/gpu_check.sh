#!/usr/bin/env bash
# The GPU check (issue 13): bf16 matmul peak, the GRPO update and forward at the Qwen2.5-1.5B
# architecture (tokens/s, MFU, peak memory), Qwen3-30B-A3B's MoE kernels and a 4-layer cut's
# GRPO step, JaxSampler decode against its HBM bound, and the demo config for 20 RL steps, as one
# table; about 8 minutes on one H200 (measured: docs/gpu/README.md).
#
# Runs from a plain checkout with the JAX already installed (no pip, no network):
#   scripts/gpu_check.sh                # on the GPU machine; with $OUT set, also
#                                       # $OUT/gpu_check.txt and $OUT/gpu_check.json
#   scripts/gpu_check.sh --cpu-smoke    # tiny shapes on the CPU (< 2 min; CI runs this)
# Options: --parts matmul,update,moe,sampler,demo   --out DIR   --moe-impl K   --timeout S
#          (see jaxrlvr/bench/gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec "${PYTHON:-python3}" -m jaxrlvr.bench.gpu_check "$@"
