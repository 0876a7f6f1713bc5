"""The tooling baseline runs with the tests: lint, format, types, and the layering."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*command: str) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize(
    "command",
    [
        ("ruff", "check", "."),
        ("ruff", "format", "--check", "."),
        ("mypy",),
        ("lint-imports",),
    ],
    ids=["ruff", "ruff-format", "mypy", "import-linter"],
)
def test_tool_passes(command: tuple[str, ...]) -> None:
    _run(str(BIN / command[0]), *command[1:])


# SQL is text a database reads, or SQLAlchemy's builders of it, or LISTEN/NOTIFY.
_SQL = re.compile(
    r"\b(SELECT\b[\s\S]*\bFROM|INSERT INTO|UPDATE\s+[\w.]+\s+(\w+\s+)?SET|DELETE FROM"
    r"|pg_advisory\w*|pg_notify|LISTEN|NOTIFY)\b"
)
_BUILDERS = {
    "text", "select", "insert", "update", "delete", "func", "and_", "or_", "tuple_", "case",
    "exists", "literal", "literal_column", "bindparam", "union_all", "cast", "column",
}  # fmt: skip
# Where each service keeps its SQL (CONVENTIONS.md): core in db/, cron and dag in their
# one store module beside their tables; the worker has none.
_SQL_HOMES = {
    "core": ("db/", "migrations/"),
    "cron": ("store.py", "tables.py", "migrations/"),
    "dag": ("store.py", "tables.py", "migrations/"),
    "worker": (),
}


def _sql_in(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text())
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            names = {alias.name for alias in node.names}
            if (node.module or "").startswith("sqlalchemy.dialects") or names & _BUILDERS:
                found.append(f"line {node.lineno}: from {node.module} import {sorted(names)}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in prose
            and _SQL.search(node.value)
        ):
            found.append(f"line {node.lineno}: {node.value.strip()[:50]!r}")
    return found


@pytest.mark.parametrize("service", sorted(_SQL_HOMES))
def test_sql_is_written_only_where_the_service_keeps_it(service: str) -> None:
    root = ROOT / "services" / service
    strays = {
        str(path.relative_to(ROOT)): found
        for path in sorted(root.rglob("*.py"))
        if not str(path.relative_to(root)).startswith(_SQL_HOMES[service])
        and (found := _sql_in(path))
    }
    assert strays == {}


def test_the_sql_detector_sees_sql() -> None:
    """The check above cannot pass by seeing nothing."""
    here = ROOT / "services" / "core" / "db" / "workers.py"
    assert any("UPDATE core.workers" in hit for hit in _sql_in(here))
    assert any("import" in hit and "text" in hit for hit in _sql_in(here))


def test_core_writes_only_in_ops() -> None:
    """Handlers parse, authorise, call and shape; loops time their work: neither opens a
    write transaction, which is ops/'s (docs/architecture.md)."""
    core = ROOT / "services" / "core"
    callers = [*sorted((core / "api").glob("*.py")), core / "loops.py", core / "app.py"]
    strays = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in callers
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ".begin()" in line
    ]
    assert strays == []


# Tests by kind; inside the larger kinds, a folder per service (core, cron, dag, worker,
# cli, common, system for what spans them).
_KINDS = {"unit", "integration", "faults", "security", "browser", "deploy"}


def test_every_test_has_one_home_and_its_own_name() -> None:
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    homeless = [
        str(f.relative_to(ROOT)) for f in files if f.relative_to(ROOT).parts[1] not in _KINDS
    ]
    names = [f.name for f in files]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert (homeless, repeated) == ([str(Path("tests/test_quality.py"))], [])
