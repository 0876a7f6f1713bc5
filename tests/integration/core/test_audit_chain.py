"""The audit trail as a hash chain, and its export (docs/security.md, "Audit export"):
every insert, from any connection, links to the one before; an edit or a removal, in the
database or in an export, is found by the verifier; the export goes on from its mark, to
a file or an S3-compatible store; retention keeps what the export has not written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from alembic import command
from click.testing import Result

from libs.common.auth import Caller
from libs.common.migrations import alembic_config
from services.core import migrate
from services.core.db import audit
from services.core.domain import auditchain
from services.core.ops import auditexport, upkeep
from services.core.settings import CoreSettings
from tests.fixtures.logs import BUCKET
from tests.support import cairn_cli, start_core, wait_for, with_engine

T = TypeVar("T")
ROOT = Caller("root", "admin")


def _record(db_url: str, count: int, tag: str = "t") -> None:
    async def work(engine: Any) -> None:
        for i in range(count):
            async with engine.begin() as conn:
                await audit.record(conn, ROOT, "team.create", f"team:{tag}{i}", after={"n": i})

    with_engine(db_url, work)


def _export_lines(db) -> list[bytes]:
    """The database's rows as an export writes them."""
    cur = db.cursor(row_factory=psycopg.rows.dict_row)
    return [auditchain.line(row) for row in cur.execute("SELECT * FROM core.audit ORDER BY id")]


def _tamper(db, sql: str) -> None:
    db.execute("ALTER TABLE core.audit DISABLE TRIGGER audit_append_only")
    db.execute(sql)
    db.execute("ALTER TABLE core.audit ENABLE TRIGGER audit_append_only")


def test_inserts_from_two_connections_at_once_form_one_chain(db_url: str, db) -> None:
    async def writer(engine: Any, tag: str) -> None:
        for i in range(25):
            async with engine.begin() as conn:
                await audit.record(conn, ROOT, "queue.pause", f"queue:{tag}{i}")
                await asyncio.sleep(0)  # let the other connection's insert queue up

    async def work(engine: Any) -> None:
        await asyncio.gather(writer(engine, "a"), writer(engine, "b"))

    with_engine(db_url, work)
    lines = _export_lines(db)
    assert len(lines) == 50
    verdict = auditchain.verify(lines, auditchain.GENESIS)
    assert verdict.ok, verdict.problem
    head = db.execute("SELECT head_id, head_hash FROM core.audit_chain").fetchone()
    last = db.execute("SELECT id, hash FROM core.audit ORDER BY id DESC LIMIT 1").fetchone()
    assert head == last
    # Both writers' rows interleave in the one chain.
    targets = [json.loads(line)["target"][6] for line in lines]
    assert "ab" in "".join(targets) or "ba" in "".join(targets)


def test_an_edit_or_a_removal_in_the_database_is_found(db_url: str, db) -> None:
    _record(db_url, 6)
    ids = [r[0] for r in db.execute("SELECT id FROM core.audit ORDER BY id")]
    _tamper(db, f"UPDATE core.audit SET target = 'team:other' WHERE id = {ids[2]}")
    verdict = auditchain.verify(_export_lines(db), auditchain.GENESIS)
    assert (verdict.rows, verdict.at_line) == (2, 3)
    assert verdict.problem is not None and "edited" in verdict.problem

    _tamper(db, f"UPDATE core.audit SET target = 'team:t2' WHERE id = {ids[2]}")
    assert auditchain.verify(_export_lines(db), auditchain.GENESIS).ok
    db.execute("BEGIN")
    db.execute("SET LOCAL cairn.audit_purge = 'on'")
    db.execute(f"DELETE FROM core.audit WHERE id = {ids[4]}")
    db.execute("COMMIT")
    verdict = auditchain.verify(_export_lines(db), auditchain.GENESIS)
    assert verdict.rows == 4 and verdict.problem is not None
    assert f"row {ids[5]}" in verdict.problem and "missing" in verdict.problem


def test_the_trigger_lets_a_sealed_row_be_neither_resealed_nor_changed(db_url: str, db) -> None:
    _record(db_url, 1)
    for sql in (
        "UPDATE core.audit SET hash = repeat('0', 64)",
        "UPDATE core.audit SET target = 'x'",
    ):
        try:
            db.execute(sql)
        except psycopg.errors.RaiseException as exc:
            assert "append-only" in str(exc)
        else:
            raise AssertionError(f"{sql} was allowed")


def test_the_export_goes_on_from_its_mark_and_cairn_audit_verify_finds_a_cut(
    db_url: str, db, tmp_path: Path
) -> None:
    out = tmp_path / "audit.jsonl"
    sink = auditexport.FileSink(out)
    _record(db_url, 3, "a")
    assert with_engine(db_url, lambda e: auditexport.export_all(e, sink, 2)) == 3
    first = db.execute("SELECT max(id) FROM core.audit").fetchone()[0]
    assert db.execute("SELECT last_id FROM core.audit_export").fetchone() == (first,)
    _record(db_url, 2, "b")
    assert with_engine(db_url, lambda e: auditexport.export_all(e, sink, 100)) == 2
    assert with_engine(db_url, lambda e: auditexport.export_all(e, sink, 100)) == 0
    written = out.read_bytes().splitlines(keepends=True)
    assert written == _export_lines(db)
    assert [json.loads(line)["target"] for line in written] == [
        "team:a0", "team:a1", "team:a2", "team:b0", "team:b1"
    ]  # fmt: skip

    def verify(path: Path, *flags: str) -> Result:
        return cairn_cli("audit", "verify", str(path), *flags, env={"CAIRN_HOME": str(tmp_path)})

    assert auditchain.verify(written, auditchain.GENESIS).rows == 5
    # A line dropped from the file, and one edited.
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(written[:2] + written[3:]))
    bad = verify(cut)
    assert bad.exit_code == 1 and "line 3" in bad.stderr and "missing" in bad.stderr
    edited = tmp_path / "edited.jsonl"
    row = json.loads(written[1])
    row["after"] = {"n": 7}
    edited.write_bytes(b"".join([written[0], json.dumps(row).encode() + b"\n", *written[2:]]))
    assert auditchain.verify(edited.read_bytes().splitlines()).at_line == 2
    # The export's second part holds on its own: its first link is trusted.
    assert auditchain.verify(written[3:]).ok


def test_the_export_to_an_s3_store_is_one_object_per_batch(
    db_url: str,
    db,
    s3: tuple[str, Any],
) -> None:
    endpoint, client = s3
    _record(db_url, 5)
    sink = auditexport.sink_for(f"s3://{BUCKET}/audit", endpoint)
    assert isinstance(sink, auditexport.ObjectSink)
    try:
        assert with_engine(db_url, lambda e: auditexport.export_all(e, sink, 2)) == 5
    finally:
        sink.objects.close()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert len(keys) == 3 and all(k.startswith("audit/") for k in keys)
    body = b"".join(client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys)
    assert body.splitlines(keepends=True) == _export_lines(db)
    assert auditchain.verify(body.splitlines(), auditchain.GENESIS).ok


def test_retention_keeps_the_rows_not_yet_exported(db_url: str, db, tmp_path: Path) -> None:
    _record(db_url, 4)
    ids = [r[0] for r in db.execute("SELECT id FROM core.audit ORDER BY id")]
    _tamper(db, "UPDATE core.audit SET at = now() - interval '500 days'")
    db.execute("UPDATE core.audit_export SET last_id = %s", (ids[1],))
    settings = CoreSettings(
        home=tmp_path, database_url=db_url, audit_export_to=str(tmp_path / "a.jsonl")
    )
    assert with_engine(db_url, lambda e: upkeep.purge_audit(e, settings)) == 2
    assert [r[0] for r in db.execute("SELECT id FROM core.audit ORDER BY id")] == ids[2:]
    # Without an export, the retention is the age alone.
    unset = CoreSettings(home=tmp_path, database_url=db_url)
    assert with_engine(db_url, lambda e: upkeep.purge_audit(e, unset)) == 2


def test_the_migration_chains_the_rows_written_before_it(db_url: str, db) -> None:
    config = alembic_config(migrate.MIGRATIONS, db_url)
    command.downgrade(config, "0016_egress")
    for i in range(3):
        db.execute(
            "INSERT INTO core.audit (actor, actor_role, action, target, after)"
            " VALUES ('root', 'admin', 'team.create', %s, %s)",
            (f"team:{i}", json.dumps({"weight": 1.5, "name": "é"})),
        )
    migrate.upgrade(db_url)
    _record(db_url, 1)  # the writer goes on from the migration's head
    lines = _export_lines(db)
    assert len(lines) == 4
    assert auditchain.verify(lines, auditchain.GENESIS).ok


def test_core_exports_on_a_schedule_and_cairn_audit_export_reads_the_chain(
    db_url: str, db, tmp_path: Path
) -> None:
    scheduled = tmp_path / "scheduled.jsonl"
    core = start_core(
        db_url, tmp_path / "core", audit_export_to=str(scheduled), audit_export_interval_s=0.1
    )
    try:
        with core.client("root", "admin") as root:
            for name in ("sre", "ops"):
                assert root.post("/v1/teams", json={"name": name}).status_code == 201
            assert root.get("/v1/audit/export", params={"after": -1}).status_code == 422
        total = db.execute("SELECT count(*) FROM core.audit").fetchone()[0]
        wait_for(lambda: scheduled.exists() and len(scheduled.read_bytes().splitlines()) == total)
        by_hand = tmp_path / "by-hand.jsonl"
        env = {"CAIRN_URL": core.url, "CAIRN_TOKEN": core.tokens["root"]}
        env["CAIRN_HOME"] = str(tmp_path)
        done = cairn_cli("audit", "export", "--to", str(by_hand), env=env)
        assert done.exit_code == 0, done.stderr
    finally:
        core.stop()
    assert by_hand.read_bytes() == scheduled.read_bytes()
    assert by_hand.read_bytes().splitlines(keepends=True) == _export_lines(db)
    assert auditchain.verify(by_hand.read_bytes().splitlines(), auditchain.GENESIS).ok
    last = db.execute("SELECT max(id) FROM core.audit").fetchone()[0]
    assert f"the last id is {last}" in done.stderr
