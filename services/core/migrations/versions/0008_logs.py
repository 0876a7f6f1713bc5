"""Live logs: an attempt's log is the chunks its worker ships while it runs, kept in
``log_chunks`` (bounded per attempt, the oldest dropped first) with a head row per attempt
in ``attempt_logs``; ``log_objects`` lists what was moved to the object store, so its
objects are deleted when their tasks are (docs/logs.md).

Revision ID: 0004_logs
Revises: 0004_fairshare
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004_logs"
down_revision = "0004_fairshare"
branch_labels = None
depends_on = None

UPGRADE = """
-- pos: where the chunk starts in the stored log (bytes of stored text, not of the file).
CREATE TABLE core.log_chunks (
    attempt_id BIGINT NOT NULL,
    pos BIGINT NOT NULL,
    bytes INTEGER NOT NULL,
    content TEXT NOT NULL,
    CONSTRAINT pk_log_chunks PRIMARY KEY (attempt_id, pos),
    CONSTRAINT fk_log_chunks_attempt_id_attempts FOREIGN KEY (attempt_id)
        REFERENCES core.attempts (id) ON DELETE CASCADE,
    CONSTRAINT ck_log_chunks_sizes CHECK (pos >= 0 AND bytes > 0)
);
-- The head: size is how far into the worker's file the log goes (the idempotency of a
-- retried batch); length where the stored log ends; start_pos where what is kept begins.
ALTER TABLE core.attempt_logs ADD COLUMN size BIGINT DEFAULT 0 NOT NULL;
ALTER TABLE core.attempt_logs ADD COLUMN length BIGINT DEFAULT 0 NOT NULL;
ALTER TABLE core.attempt_logs ADD COLUMN start_pos BIGINT DEFAULT 0 NOT NULL;
ALTER TABLE core.attempt_logs ADD COLUMN archived_at TIMESTAMP WITH TIME ZONE;
ALTER TABLE core.attempt_logs ADD CONSTRAINT ck_attempt_logs_positions
    CHECK (size >= 0 AND start_pos >= 0 AND length >= start_pos);
INSERT INTO core.log_chunks (attempt_id, pos, bytes, content)
    SELECT attempt_id, 0, octet_length(content), content FROM core.attempt_logs
    WHERE content <> '';
UPDATE core.attempt_logs SET length = octet_length(content), size = octet_length(content);
ALTER TABLE core.attempt_logs DROP COLUMN content;
CREATE INDEX ix_attempt_logs_unarchived ON core.attempt_logs (attempt_id)
    WHERE archived_at IS NULL;

-- Objects in the store, by key; no foreign key: the row outlives its task until the
-- retention loop has deleted the object.
CREATE TABLE core.log_objects (
    key TEXT NOT NULL,
    task_id BIGINT NOT NULL,
    attempt_id BIGINT NOT NULL,
    archived_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_log_objects PRIMARY KEY (key)
);
CREATE INDEX ix_log_objects_archived_at ON core.log_objects (archived_at);
"""

DOWNGRADE = """
DROP TABLE core.log_objects;
ALTER TABLE core.attempt_logs ADD COLUMN content TEXT DEFAULT '' NOT NULL;
UPDATE core.attempt_logs h SET content = coalesce(
    (SELECT string_agg(c.content, '' ORDER BY c.pos) FROM core.log_chunks c
     WHERE c.attempt_id = h.attempt_id), '');
ALTER TABLE core.attempt_logs ALTER COLUMN content DROP DEFAULT;
DROP INDEX core.ix_attempt_logs_unarchived;
ALTER TABLE core.attempt_logs DROP CONSTRAINT ck_attempt_logs_positions;
ALTER TABLE core.attempt_logs DROP COLUMN archived_at;
ALTER TABLE core.attempt_logs DROP COLUMN start_pos;
ALTER TABLE core.attempt_logs DROP COLUMN length;
ALTER TABLE core.attempt_logs DROP COLUMN size;
DROP TABLE core.log_chunks;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
