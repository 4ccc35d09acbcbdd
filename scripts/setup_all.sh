#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and the peer venvs (.venv-lmcache, .venv-vllm) side by
# side: mostly downloads and unpacking, so three at once take about as long as the slowest.
# Each line of output is prefixed with its script's name; the exit status is non-zero when
# any of them failed, and names those.
set -uo pipefail
cd "$(dirname "$0")/.."

scripts=(setup.sh setup_lmcache_venv.sh setup_vllm_venv.sh)
pids=()
for s in "${scripts[@]}"; do
    ( set -o pipefail; "./scripts/$s" 2>&1 | sed -u "s/^/[${s%.sh}] /" ) &
    pids+=($!)
done
failed=()
for i in "${!scripts[@]}"; do
    wait "${pids[$i]}" || failed+=("${scripts[$i]}")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "setup_all: failed: ${failed[*]} (its lines above are prefixed with its name)" >&2
    exit 1
fi
