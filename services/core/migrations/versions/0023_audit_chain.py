"""The audit trail as a hash chain, and its export (issue 34, docs/security.md "Audit
export"): each row gets ``prev_hash`` and ``hash`` (``services.core.domain.auditchain``);
``core.audit_chain`` is the chain's head, one row whose lock orders the inserts of every
replica into one chain; ``core.audit_export`` the last id the scheduled export has
written. The rows written before are chained here, in id order. The append-only trigger
now lets a row be sealed once (its two hashes set, nothing else changed).

Revision ID: 0017_audit_chain
Revises: 0016_egress
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import JSONB

from services.core.domain import auditchain

revision = "0017_audit_chain"
down_revision = "0016_egress"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.audit ADD COLUMN prev_hash TEXT, ADD COLUMN hash TEXT;

CREATE TABLE core.audit_chain (
    one BOOLEAN DEFAULT true NOT NULL,
    head_id BIGINT DEFAULT 0 NOT NULL,
    head_hash TEXT NOT NULL,
    CONSTRAINT pk_audit_chain PRIMARY KEY (one),
    CONSTRAINT ck_audit_chain_one CHECK (one)
);

CREATE TABLE core.audit_export (
    one BOOLEAN DEFAULT true NOT NULL,
    last_id BIGINT DEFAULT 0 NOT NULL,
    exported_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_audit_export PRIMARY KEY (one),
    CONSTRAINT ck_audit_export_one CHECK (one)
);
INSERT INTO core.audit_export (one) VALUES (true);

CREATE OR REPLACE FUNCTION core.audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('cairn.audit_purge', true) = 'on' THEN
        RETURN OLD;
    END IF;
    -- The writer seals its row once, in the insert's transaction: the hashes only.
    IF TG_OP = 'UPDATE' AND OLD.hash IS NULL AND NEW.hash IS NOT NULL
        AND NEW.prev_hash IS NOT NULL
        AND (NEW.id, NEW.at, NEW.actor, NEW.actor_role, NEW.action, NEW.target, NEW.source,
             NEW.before, NEW.after)
            IS NOT DISTINCT FROM
            (OLD.id, OLD.at, OLD.actor, OLD.actor_role, OLD.action, OLD.target, OLD.source,
             OLD.before, OLD.after)
    THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'core.audit is append-only (% refused)', TG_OP;
END
$$;
"""

DOWNGRADE = """
CREATE OR REPLACE FUNCTION core.audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('cairn.audit_purge', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'core.audit is append-only (% refused)', TG_OP;
END
$$;
DROP TABLE core.audit_export;
DROP TABLE core.audit_chain;
ALTER TABLE core.audit DROP COLUMN hash, DROP COLUMN prev_hash;
"""

_ROWS = text(
    "SELECT id, at, actor, actor_role, action, target, source, before, after"
    " FROM core.audit ORDER BY id"
).columns(before=JSONB, after=JSONB)
_SEAL = text("UPDATE core.audit SET prev_hash = :prev_hash, hash = :hash WHERE id = :id")


def upgrade() -> None:
    op.execute(UPGRADE)
    bind = op.get_bind()
    prev, head_id, seals = auditchain.GENESIS, 0, []
    for row in bind.execute(_ROWS).mappings():
        digest = auditchain.link(prev, dict(row))
        seals.append({"id": row["id"], "prev_hash": prev, "hash": digest})
        prev, head_id = digest, row["id"]
    if seals:
        bind.execute(_SEAL, seals)
    bind.execute(
        text("INSERT INTO core.audit_chain (one, head_id, head_hash) VALUES (true, :i, :h)"),
        {"i": head_id, "h": prev},
    )


def downgrade() -> None:
    op.execute(DOWNGRADE)
