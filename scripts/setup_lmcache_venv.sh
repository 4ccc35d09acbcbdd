#!/usr/bin/env bash
# Create (or reuse) .venv-lmcache in the repo root: LMCache 0.5.6 on CPU torch, used only
# as the reference lm:// server/client for interop tests and benchmarks.
# Resolving LMCache's dependencies takes ~5 minutes and ~1.8 GB on disk.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LMCACHE_VENV:-$repo_root/.venv-lmcache}"
python="${PYTHON:-python3}"

if [[ -x "$venv/bin/lmcache_server" ]] && "$venv/bin/python" -c \
    "import lmcache.v1.storage_backend.connector.lm_connector" 2>/dev/null; then
  echo "reusing $venv"
  exit 0
fi

"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --upgrade pip >/dev/null
# Pin torch first: a bare requirement would pull a multi-GB CUDA build.
"$venv/bin/python" -m pip install "torch==2.13.0"
"$venv/bin/python" -m pip install "lmcache==0.5.6" "torch==2.13.0"
"$venv/bin/python" -c "import lmcache.v1.storage_backend.connector.lm_connector; print('lmcache ok')"
echo "created $venv"
