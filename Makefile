# The two commands a new user needs (see README.md).
PY := .venv/bin/python

.PHONY: serve test lint setup

setup:
	./scripts/setup.sh

# Set up, then serve the built-in demo model with lmkv (CPU + disk tiers) on 127.0.0.1:8000.
serve: setup
	LMKV_CONFIG_FILE=$${LMKV_CONFIG_FILE:-examples/local_cpu_disk.yaml} .venv/bin/engine serve $(ARGS)

# Set up, lint, and run the whole test suite.
test: setup
	.venv/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

lint: setup
	.venv/bin/ruff check .
