"""Notifications: subscriptions per owner, the outbox of deliveries, the answers log, the
matcher's cursors, and an index to find passed deadlines.

Revision ID: 0004_notifications
Revises: 0004_isolation
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004_notifications"
down_revision = "0004_isolation"
branch_labels = None
depends_on = None

UPGRADE = """
-- ``owner`` is a principal's name; a team's name will fit the same column.
-- ``secret`` holds the HMAC key as text, so it can later hold it encrypted instead.
CREATE TABLE core.subscriptions (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    events TEXT[] NOT NULL,
    queue TEXT,
    labels JSONB DEFAULT '{}'::jsonb NOT NULL,
    url TEXT NOT NULL,
    secret TEXT NOT NULL,
    enabled BOOLEAN DEFAULT true NOT NULL,
    disabled_reason TEXT,
    failures INTEGER DEFAULT 0 NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_subscriptions PRIMARY KEY (id),
    CONSTRAINT uq_subscriptions_owner_name UNIQUE (owner, name),
    CONSTRAINT ck_subscriptions_disabled_has_reason CHECK (enabled = (disabled_reason IS NULL)),
    CONSTRAINT ck_subscriptions_failures_non_negative CHECK (failures >= 0),
    CONSTRAINT ck_subscriptions_has_events CHECK (cardinality(events) > 0)
);

-- The outbox: one row per (subscription, event), written by the matcher, the deadline
-- scan or a service's post, and read by the delivery loop. ``next_at`` is when it is due,
-- or while a replica delivers it, when that replica's lease ends.
CREATE TABLE core.notifications (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    subscription_id BIGINT NOT NULL,
    event TEXT NOT NULL,
    dedupe_key TEXT NOT NULL,
    delivery_id UUID DEFAULT gen_random_uuid() NOT NULL,
    payload JSONB NOT NULL,
    state TEXT DEFAULT 'pending' NOT NULL,
    tries INTEGER DEFAULT 0 NOT NULL,
    next_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    finished_at TIMESTAMP WITH TIME ZONE,
    last_status INTEGER,
    last_error TEXT,
    last_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_notifications PRIMARY KEY (id),
    CONSTRAINT fk_notifications_subscription_id_subscriptions FOREIGN KEY (subscription_id)
        REFERENCES core.subscriptions (id) ON DELETE CASCADE,
    CONSTRAINT uq_notifications_subscription_id_dedupe_key UNIQUE (subscription_id, dedupe_key),
    CONSTRAINT uq_notifications_delivery_id UNIQUE (delivery_id),
    CONSTRAINT ck_notifications_state CHECK (state IN ('delivered', 'failed', 'pending')),
    CONSTRAINT ck_notifications_final_has_finished_at
        CHECK ((state = 'pending') = (finished_at IS NULL)),
    CONSTRAINT ck_notifications_tries_non_negative CHECK (tries >= 0)
);
CREATE INDEX ix_notifications_next_at ON core.notifications (next_at) WHERE state = 'pending';
CREATE INDEX ix_notifications_finished_at ON core.notifications (finished_at)
    WHERE finished_at IS NOT NULL;

-- Every answer a webhook gave (or the error instead), newest read first.
CREATE TABLE core.notification_answers (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    notification_id BIGINT NOT NULL,
    subscription_id BIGINT NOT NULL,
    try INTEGER NOT NULL,
    at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    status INTEGER,
    error TEXT,
    duration_ms DOUBLE PRECISION NOT NULL,
    CONSTRAINT pk_notification_answers PRIMARY KEY (id),
    CONSTRAINT fk_notification_answers_notification_id_notifications
        FOREIGN KEY (notification_id) REFERENCES core.notifications (id) ON DELETE CASCADE
);
CREATE INDEX ix_notification_answers_subscription_id_id
    ON core.notification_answers (subscription_id, id);
CREATE INDEX ix_notification_answers_notification_id
    ON core.notification_answers (notification_id);

-- Where the matcher is in core's event feed, and up to which deadline the scan has
-- looked. Both start now: history from before the migration notifies nobody.
CREATE TABLE core.notify_cursors (
    name TEXT NOT NULL,
    feed_xid BIGINT DEFAULT 0 NOT NULL,
    feed_id BIGINT DEFAULT 0 NOT NULL,
    deadline_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    deadline_id BIGINT DEFAULT 0 NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_notify_cursors PRIMARY KEY (name)
);
INSERT INTO core.notify_cursors (name, feed_xid, feed_id)
VALUES ('matcher', pg_snapshot_xmin(pg_current_snapshot())::text::bigint - 1,
        9223372036854775807);
INSERT INTO core.notify_cursors (name) VALUES ('deadlines');

CREATE INDEX ix_tasks_deadline_id ON core.tasks (deadline, id) WHERE deadline IS NOT NULL;
"""

DOWNGRADE = """
DROP INDEX core.ix_tasks_deadline_id;
DROP TABLE core.notify_cursors;
DROP TABLE core.notification_answers;
DROP TABLE core.notifications;
DROP TABLE core.subscriptions;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
