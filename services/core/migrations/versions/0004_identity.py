"""Identity: named tokens with expiry and last use, teams, team-owned tasks, encrypted
secrets, and the append-only audit trail.

Revision ID: 0004_identity
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004_identity"
down_revision = "0003"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.tokens ADD COLUMN name TEXT DEFAULT '' NOT NULL;
ALTER TABLE core.tokens ADD COLUMN expires_at TIMESTAMP WITH TIME ZONE;
ALTER TABLE core.tokens ADD COLUMN last_used_at TIMESTAMP WITH TIME ZONE;
ALTER TABLE core.tokens ADD COLUMN created_by TEXT;
ALTER TABLE core.tokens ADD CONSTRAINT ck_tokens_name_length CHECK (length(name) <= 100);

CREATE TABLE core.teams (
    name TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    created_by TEXT NOT NULL,
    CONSTRAINT pk_teams PRIMARY KEY (name),
    CONSTRAINT ck_teams_name_length CHECK (length(name) BETWEEN 1 AND 64)
);

CREATE TABLE core.team_members (
    team TEXT NOT NULL,
    member TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    added_by TEXT NOT NULL,
    CONSTRAINT pk_team_members PRIMARY KEY (team, member),
    CONSTRAINT fk_team_members_team_teams FOREIGN KEY (team)
        REFERENCES core.teams (name) ON DELETE CASCADE
);
CREATE INDEX ix_team_members_member ON core.team_members (member);

-- A task may be owned by a team its submitter belongs to: its members see and act on it.
ALTER TABLE core.tasks ADD COLUMN team TEXT;
CREATE INDEX ix_tasks_team_id ON core.tasks (team, id) WHERE team IS NOT NULL;

-- Values are AES-GCM ciphertexts bound to their scope and name; the key is never here.
CREATE TABLE core.secrets (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT,
    team TEXT,
    name TEXT NOT NULL,
    key_id TEXT NOT NULL,
    nonce BYTEA NOT NULL,
    ciphertext BYTEA NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    created_by TEXT NOT NULL,
    updated_by TEXT NOT NULL,
    CONSTRAINT pk_secrets PRIMARY KEY (id),
    CONSTRAINT ck_secrets_one_scope CHECK ((owner IS NULL) <> (team IS NULL)),
    CONSTRAINT ck_secrets_name_length CHECK (length(name) BETWEEN 1 AND 128)
);
CREATE UNIQUE INDEX uq_secrets_owner_name ON core.secrets (owner, name) WHERE owner IS NOT NULL;
CREATE UNIQUE INDEX uq_secrets_team_name ON core.secrets (team, name) WHERE team IS NOT NULL;

CREATE TABLE core.audit (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    actor TEXT NOT NULL,
    actor_role TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    source TEXT,
    before JSONB,
    after JSONB,
    CONSTRAINT pk_audit PRIMARY KEY (id)
);
CREATE INDEX ix_audit_at ON core.audit (at);
CREATE INDEX ix_audit_actor_id ON core.audit (actor, id);
CREATE INDEX ix_audit_action_id ON core.audit (action, id);

-- Append-only: rows are never changed, and leave only through the retention purge,
-- which says so in its own transaction (SET LOCAL cairn.audit_purge = 'on').
CREATE FUNCTION core.audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('cairn.audit_purge', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'core.audit is append-only (% refused)', TG_OP;
END
$$;
CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON core.audit
    FOR EACH ROW EXECUTE FUNCTION core.audit_append_only();
CREATE TRIGGER audit_no_truncate BEFORE TRUNCATE ON core.audit
    FOR EACH STATEMENT EXECUTE FUNCTION core.audit_append_only();
"""

DOWNGRADE = """
DROP TABLE core.audit;
DROP FUNCTION core.audit_append_only();
DROP TABLE core.secrets;
DROP INDEX core.ix_tasks_team_id;
ALTER TABLE core.tasks DROP COLUMN team;
DROP TABLE core.team_members;
DROP TABLE core.teams;
ALTER TABLE core.tokens DROP CONSTRAINT ck_tokens_name_length;
ALTER TABLE core.tokens DROP COLUMN created_by;
ALTER TABLE core.tokens DROP COLUMN last_used_at;
ALTER TABLE core.tokens DROP COLUMN expires_at;
ALTER TABLE core.tokens DROP COLUMN name;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
