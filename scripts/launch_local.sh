#!/usr/bin/env bash
# Starts N processes of one `jaxrlvr train` job on this machine (docs/multihost.md):
#   scripts/launch_local.sh N CONFIG [key=value ...] [--resume]
# Each process gets JAXRLVR_LOCAL_DEVICES fake CPU devices (default 4), gloo collectives, and
# the coordinator 127.0.0.1:$JAXRLVR_PORT (default: a free port). Output lines are prefixed with
# the process id. Exits with the first non-zero status of any process (0 when all succeed).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 N CONFIG [key=value ...] [--resume]" >&2
  exit 2
fi
n=$1
shift
case "$n" in '' | *[!0-9]* | 0) echo "$0: N must be a positive integer, got '$n'" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
port=${JAXRLVR_PORT:-$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
devices=${JAXRLVR_LOCAL_DEVICES:-4}
pids=()
for ((i = 0; i < n; i++)); do
  (
    export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices"
    export JAXRLVR_COORDINATOR="127.0.0.1:$port" JAXRLVR_NUM_PROCESSES="$n" JAXRLVR_PROCESS_ID="$i"
    exec "$python" -m jaxrlvr.cli train "$@" 2>&1 | sed -u "s/^/[p$i] /"
  ) &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  if ! wait "$pid"; then
    rc=$?
    [ "$status" -eq 0 ] && status=$rc
  fi
done
exit "$status"
