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

# The OpenID provider the sign-in tests start (panva's oidc-provider on Node.js): its
# packages come from the lock file here, never at test time; only `make test` needs them
# (`make up` needs no Node.js).
OIDC := tests/fixtures/oidc
$(OIDC)/node_modules/.installed: $(OIDC)/package.json $(OIDC)/package-lock.json
	npm ci --prefix $(OIDC) --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed $(VENV)/compose_spec.json

# With the demo: a few tasks, a schedule and a workflow, loaded once (keys make a restart
# find the same work); `.venv/bin/cairn up` starts without it.
up: install
	$(BIN)/cairn up --demo

# Two pytest processes at once: the main suite (-n 2) and, beside it, the tests that wait
# mostly on clusters or whole systems of their own: the deployment test (tests/deploy: the
# network and its containers), the PostgreSQL failover test (a Patroni cluster), the two
# that drive `cairn up` end to end (minutes each, mostly waiting on its processes), the
# network cut (waits out TCP keepalives), the three longest fault tests of the suite
# (kills and restarts of whole systems, 20-40 s each, mostly waiting: beside, they keep the
# suite under its 15 minutes), and three more that mostly wait on processes of their own
# (a usage decay, an agent's held lease, a notifier's restart; 14-20 s each: the suite
# reached 14:14 with them), and three that wait on lock timeouts and holds (core's
# migration blocked and retried, its index builds waiting out a report, killed, raced by a
# second run, 30 s; every service's migrations and starts behind a blocker, 25 s, both at
# load 5 on the shared 2 cores; a DAG page of starts held, 5 s), and three that wait on
# processes, fuses and holds (the system behind PgBouncer, 17 s; an agent's start on a FUSE
# source that never answers, 20 s; an output flood that runs `yes` 4 s and waits out its
# log, 21 s: alone, at load 2-4), and two fault tests that wait out kills, a database
# restart and a worker declared dead behind its cut link (core's Jepsen-style run, 27 s;
# the network partition, 20 s, inside `pytest -n 2 tests/faults`), and two that wait out
# an agent's hang bound (6 s, twice: 17 s) and a database's kill and restart (15 s), and
# two that are long in one process rather than waiting (the state machine's property run,
# 11-20 s of round trips to the database; the offboarding tests, two cores each, 12 s: the
# suite reached 15:20 with them, 2026-12-06), and four that are long in one process
# (core as two uvicorn processes, 15 s; the secrets CLI, 9-14 s; cron's token check passed
# between two cores, 13-18 s: the suite reached 16:12 on a slower day, the tests beside it
# 13:25, 2026-12-06 evening); their output is kept and printed when both
# are done. Fails
# when either fails. The cluster tests skip themselves without their tools (and the
# deployment test without root), unless CAIRN_REQUIRE_DEPLOY=1 (.ci/run); docs/deploy.md.
# The suite's two workers steal queued tests from each other (--dist worksteal): with the
# default (load), the tests already queued on one worker stay there, and one worker ran
# the last 150 of them (2.5 minutes) alone while the other had finished.
BESIDE := tests/deploy tests/faults/system/test_failover.py \
	tests/faults/system/test_cli_e2e.py tests/faults/system/test_cairn_up.py \
	tests/faults/system/test_network_cut.py tests/faults/system/test_jepsen_flows.py \
	tests/integration/system/test_prometheus_e2e.py tests/faults/cron/test_replicas.py \
	tests/integration/core/test_fair_usage.py tests/faults/worker/test_claim_ahead_agent.py \
	tests/faults/core/test_notify_restart.py tests/integration/core/test_migration_locks.py \
	tests/integration/dag/test_starts_hold.py tests/integration/system/test_migration_blocked.py \
	tests/integration/system/test_behind_pgbouncer.py tests/security/test_unanswered_source.py \
	tests/faults/core/test_jepsen.py tests/faults/worker/test_partition.py \
	tests/faults/worker/test_hung_agent.py tests/faults/core/test_database_restart.py \
	tests/integration/core/test_offboarding.py \
	tests/integration/core/test_state_machine_property.py \
	tests/integration/core/test_core_workers.py tests/faults/cron/test_token_check_failover.py
# Single tests run beside the suite (deselected from it): their files' other tests stay in it.
BESIDE_ONE := tests/security/test_hostile_tasks.py::test_a_flood_of_output_keeps_the_workers_log_file_to_the_bound \
	tests/integration/core/test_secrets.py::test_the_cli_stores_and_uses_secrets_without_showing_them
test: install $(OIDC)/node_modules/.installed
	@# Bytecode for every process the tests start (agents, sidecars, cores, the CLI): where
	@# PYTHONDONTWRITEBYTECODE is set, as on the build machines, none is written otherwise,
	@# and each process compiled the project's sources again (0.2-0.3 s of CPU a start).
	@$(BIN)/python -m compileall -q -j 0 services libs cairn tests bench >/dev/null
	@log=$$(mktemp); \
	$(BIN)/python -m pytest -p no:xdist -p no:cacheprovider $(BESIDE) $(BESIDE_ONE) -q -rA --durations=15 >"$$log" 2>&1 & deploy=$$!; \
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=25 $(addprefix --ignore=,$(BESIDE)) \
		$(addprefix --deselect=,$(BESIDE_ONE)); main=$$?; \
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
