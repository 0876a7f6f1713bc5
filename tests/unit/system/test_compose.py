"""compose/docker-compose.yml is valid under the Compose Specification's schema, and every
Cairn process in it runs a command the CLI accepts with settings its process reads."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml
from pydantic_settings import BaseSettings

from cairn.cli import app
from libs.common.settings import CairnSettings
from services.core.settings import CoreSettings, SecretsKeySettings
from services.cron.settings import CronSettings
from services.dag.settings import DagSettings
from services.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SPEC = ROOT / ".venv" / "compose_spec.json"  # made by `make install` (tests/compose_spec.py)

# The settings each command reads.
SETTINGS: dict[str, type[BaseSettings]] = {
    "core": CoreSettings,
    "cron": CronSettings,
    "dag": DagSettings,
    "worker": WorkerSettings,
    "migrate": SecretsKeySettings,  # a migration seals with core's keys
    "token": CairnSettings,
}


def parse(argv: list[str]) -> dict[str, Any]:
    """The options the CLI parses from ``argv``, without running the command; a command or
    option the CLI does not have fails the test."""
    # Typer carries its own copy of click, so groups are told by what they can do.
    command: Any = typer.main.get_command(app)
    ctx = command.make_context("cairn", list(argv))
    params: dict[str, Any] = dict(ctx.params)
    rest = [*ctx._protected_args, *ctx.args]  # the subcommand and its arguments
    while hasattr(command, "resolve_command") and rest:
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        ctx = sub.make_context(name, rest, parent=ctx)
        params.update(ctx.params)
        command = sub
        rest = [*ctx._protected_args, *ctx.args] if hasattr(sub, "resolve_command") else []
    return params


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def _env_names(settings: type[BaseSettings]) -> set[str]:
    return {f"CAIRN_{name.upper()}" for name in settings.model_fields}


def _runs_cairn(service: dict[str, Any]) -> bool:
    """Built from the Cairn image and running cairn (PostgreSQL runs from it too)."""
    cairn = (None, ["sh", "-c"], ["cairn-worker-entrypoint"])  # the last ends in `exec cairn`
    return "build" in service and service.get("entrypoint") in cairn


def _cairn_commands(service: dict[str, Any]) -> list[list[str]]:
    """The cairn command lines a service runs (the image's entrypoint is ``cairn``)."""
    command = service.get("command", ["core"])
    if service.get("entrypoint") == ["sh", "-c"]:
        lines = " ".join(command).split("&&")
        return [shlex.split(line)[1:] for line in lines if shlex.split(line)[0] == "cairn"]
    return [list(command)]


def test_the_file_is_valid_under_the_compose_specification() -> None:
    assert SPEC.exists(), "run `make install` (it fetches the schema)"
    schema = json.loads(SPEC.read_text())
    # Its $schema names draft 2019-09 by an address jsonschema does not know: say so.
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_compose())]
    assert errors == []


def test_it_runs_every_part_of_cairn() -> None:
    services = _compose()["services"]
    commands = {
        tuple(c[:1]) for s in services.values() if _runs_cairn(s) for c in _cairn_commands(s)
    }
    assert {("core",), ("cron",), ("dag",), ("worker",), ("migrate",), ("token",)} <= commands
    assert sum(1 for s in services.values() if s.get("command") == ["core"]) == 2
    assert sum(1 for s in services.values() if s.get("command") == ["cron"]) == 2


@pytest.mark.parametrize(
    "name", sorted(n for n, s in _compose()["services"].items() if _runs_cairn(s))
)
def test_each_command_and_its_environment_match_the_cli(name: str) -> None:
    service = _compose()["services"][name]
    commands = _cairn_commands(service)
    assert commands, f"{name} runs no cairn command"
    readers: set[str] = set()
    from_env: set[str] = set()
    for argv in commands:
        params = parse(argv)
        readers |= _env_names(SETTINGS[argv[0]])
        if params.get("from_env"):
            from_env.add(params["from_env"])
    unknown = {
        key
        for key in service.get("environment", {})
        if key.startswith("CAIRN_") and key not in readers | from_env
    }
    assert not unknown, f"{name} sets variables its process does not read: {sorted(unknown)}"
    for key in from_env:
        assert key in service["environment"], f"{name} registers {key} but does not set it"


def test_workers_run_as_root_to_isolate_and_never_get_the_database_url() -> None:
    worker = _compose()["services"]["worker"]
    assert "CAIRN_DATABASE_URL" not in worker["environment"]
    assert "CAIRN_TOKEN" not in worker["environment"]
    # mount namespaces and its cgroups; the egress rules in its own network namespace
    assert worker["user"] == "0:0" and worker["cap_add"] == ["SYS_ADMIN", "NET_ADMIN"]


def test_the_cli_check_catches_a_mistake() -> None:
    assert parse(["token", "create", "x", "--from-env", "V"])["from_env"] == "V"
    with pytest.raises(Exception, match="No such option"):
        parse(["core", "--port", "1"]) and parse(["token", "create", "x", "--form-env", "V"])
    with pytest.raises(Exception, match="No such command"):
        parse(["crn"])


def test_the_schema_check_catches_a_mistake() -> None:
    broken = _compose()
    broken["services"]["dag"]["comand"] = ["dag"]  # a typo the schema must refuse
    validator = jsonschema.Draft201909Validator(json.loads(SPEC.read_text()))
    assert any("comand" in e.message for e in validator.iter_errors(broken))


def test_every_file_the_image_installs_from_compose_is_in_its_build_context() -> None:
    """compose/Dockerfile installs scripts from compose/; .dockerignore admits only what
    it lists, so a script missing there breaks the image's build (it did, for PgBouncer's
    entrypoint, only in the deployment test)."""
    import re

    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    installed = set(re.findall(r"install -m \d+ (compose/[\w.-]+)", dockerfile))
    admitted = {
        line[1:].strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert installed, "the Dockerfile installs nothing from compose/: the pattern is stale"
    assert installed <= admitted, installed - admitted
