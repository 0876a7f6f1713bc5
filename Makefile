# The two commands that matter: `make up` starts the system, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install up test bench screenshots

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

$(VENV)/compose_spec.json: | $(VENV)/.installed
	$(BIN)/python tests/compose_spec.py $@

install: $(VENV)/.installed $(VENV)/compose_spec.json

# With the demo: a few tasks, a schedule and a workflow, loaded once (keys make a restart
# find the same work); `.venv/bin/cairn up` starts without it.
up: install
	$(BIN)/cairn up --demo

test: install
	$(BIN)/python -m pytest -n 2

bench: install
	$(BIN)/python bench/submit.py

# Refresh docs/screenshots/*.png from the browser tests (needs /usr/bin/chromium).
screenshots: install
	CAIRN_SCREENSHOTS=docs/screenshots $(BIN)/python -m pytest -p no:xdist tests/browser
