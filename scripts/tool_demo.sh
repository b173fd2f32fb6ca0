#!/usr/bin/env bash
# The tool-use demo (configs/tool_demo.yaml; docs/tools.md): install jaxrlvr, train (SFT on written
# Python-tool traces, then GRPO on multi-turn rollouts that run the tool in the bubblewrap sandbox),
# evaluate the final checkpoint without the tool, and plot held-out accuracy and tool calls per
# rollout against steps into runs/tool_demo/plots/. Extra arguments go to `jaxrlvr train`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup_env.sh | tail -n1)
BIN="$(dirname "$PY")/jaxrlvr"
OUT=runs/tool_demo
for arg in "$@"; do [[ "$arg" == run.out_dir=* ]] && OUT="${arg#run.out_dir=}"; done
"$BIN" train configs/tool_demo.yaml "$@"
echo "== held-out accuracy of the final checkpoint WITHOUT the tool (env.tools=[]):"
"$BIN" eval configs/tool_demo.yaml "env.tools=[]" --checkpoint "$OUT" | grep -E "eval/(accuracy|format_rate)"
"$BIN" plot "$OUT" --keys eval/accuracy,tool/calls_per_rollout,reward_mean
