# The two commands that matter: `make up` starts the system, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install up test test-deploy bench screenshots openapi

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

# Two pytest processes at once: the main suite (-n 2) and, beside it, the tests that wait
# mostly on clusters or whole systems of their own: the deployment test (tests/deploy: the
# network and its containers), the PostgreSQL failover test (a Patroni cluster), and the
# two that drive `cairn up` end to end (minutes each, mostly waiting on its processes);
# their output is kept and printed when both are done. Fails when either fails. Both skip themselves without
# their tools (and the deployment test without root), unless CAIRN_REQUIRE_DEPLOY=1
# (.ci/run); docs/deploy.md.
BESIDE := tests/deploy tests/faults/system/test_failover.py \
	tests/faults/system/test_cli_e2e.py tests/faults/system/test_cairn_up.py \
	tests/faults/system/test_network_cut.py
test: install
	@log=$$(mktemp); \
	$(BIN)/python -m pytest -p no:xdist -p no:cacheprovider $(BESIDE) -q -rA >"$$log" 2>&1 & deploy=$$!; \
	$(BIN)/python -m pytest -n 2 --durations=25 $(addprefix --ignore=,$(BESIDE)); main=$$?; \
	wait $$deploy; deployed=$$?; \
	echo "=== the tests run beside the suite ($(BESIDE)) ==="; cat "$$log"; rm -f "$$log"; \
	echo "make test: the suite exited $$main, the tests beside it $$deployed"; \
	[ $$main -eq 0 ] && [ $$deployed -eq 0 ]

# The deployment test alone (about 5 minutes).
test-deploy: install
	$(BIN)/python -m pytest -p no:xdist tests/deploy -q -rA

bench: install
	$(BIN)/python bench/submit.py

# Refresh docs/screenshots/*.png from the browser tests (needs /usr/bin/chromium).
screenshots: install
	CAIRN_SCREENSHOTS=docs/screenshots $(BIN)/python -m pytest -p no:xdist tests/browser

# Regenerate docs/openapi/{core,cron,dag}.json from the services (docs/api.md); refuses a
# breaking change to /v1 without a major version step.
openapi: install
	PYTHONPATH=$(CURDIR) $(BIN)/python -m tests.openapi_contract --write
