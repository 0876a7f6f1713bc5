"""Webhook signing secrets sealed at rest, and the time of a subscription's last test.

``core.subscriptions.secret`` held each HMAC key in plaintext. It becomes
``secret_key_id``, ``secret_nonce`` and ``secret_sealed``: AES-256-GCM with the secrets
keys (``CAIRN_SECRETS_KEY`` / ``CAIRN_SECRETS_KEY_FILE``, as core reads them), bound to
the subscription's owner and name. Existing rows are sealed here, so the keys must be
configured where migrations run when there are any (the same environment core starts
with). ``tested_at`` bounds ``test`` deliveries to one per ``CAIRN_NOTIFY_TEST_INTERVAL_S``.

Revision ID: 0009_webhook_secrets
Revises: 0008_flow_last
Create Date: 2026-12-03
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0009_webhook_secrets"
down_revision = "0008_flow_last"
branch_labels = None
depends_on = None


def _context(owner: str, name: str) -> bytes:
    # Spelled here as services/core/domain/notify.secret_context spells it today: a
    # migration does what it did when it was written.
    return f"cairn-webhook-secret\x00{owner}\x00{name}".encode()


def _box() -> Any:
    """The secrets keys core uses, read from the environment migrations run in: only the
    keys' settings (``CAIRN_SECRETS_KEY`` / ``CAIRN_SECRETS_KEY_FILE``, else the key file
    in ``CAIRN_HOME``), and never a new key: a key made here would not be core's."""
    from services.core.app import secret_box
    from services.core.domain.keys import BadKey
    from services.core.settings import SecretsKeySettings

    try:
        return secret_box(SecretsKeySettings(), create=False)
    except (BadKey, ValueError) as exc:
        raise RuntimeError(
            "sealing the signing secrets of the existing webhook subscriptions needs core's "
            "secrets key where migrations run: set CAIRN_SECRETS_KEY or "
            f"CAIRN_SECRETS_KEY_FILE as core has them ({exc})"
        ) from None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE core.subscriptions ADD COLUMN secret_key_id text, "
        "ADD COLUMN secret_nonce bytea, ADD COLUMN secret_sealed bytea, "
        "ADD COLUMN tested_at timestamptz"
    )
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, owner, name, secret FROM core.subscriptions")).all()
    box = _box() if rows else None
    for row in rows:
        assert box is not None
        kid, nonce, sealed = box.seal(row.secret, _context(row.owner, row.name))
        conn.execute(
            sa.text(
                "UPDATE core.subscriptions SET secret_key_id = :kid, secret_nonce = :nonce, "
                "secret_sealed = :sealed WHERE id = :id"
            ),
            {"kid": kid, "nonce": nonce, "sealed": sealed, "id": row.id},
        )
    op.execute(
        "ALTER TABLE core.subscriptions DROP COLUMN secret, "
        "ALTER COLUMN secret_key_id SET NOT NULL, ALTER COLUMN secret_nonce SET NOT NULL, "
        "ALTER COLUMN secret_sealed SET NOT NULL"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE core.subscriptions ADD COLUMN secret text")
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT id, owner, name, secret_key_id, secret_nonce, secret_sealed "
            "FROM core.subscriptions"
        )
    ).all()
    box = _box() if rows else None
    for row in rows:
        assert box is not None
        context = _context(row.owner, row.name)
        plain = box.open(row.secret_key_id, row.secret_nonce, row.secret_sealed, context)
        conn.execute(
            sa.text("UPDATE core.subscriptions SET secret = :secret WHERE id = :id"),
            {"secret": plain, "id": row.id},
        )
    op.execute(
        "ALTER TABLE core.subscriptions ALTER COLUMN secret SET NOT NULL, "
        "DROP COLUMN secret_key_id, DROP COLUMN secret_nonce, DROP COLUMN secret_sealed, "
        "DROP COLUMN tested_at"
    )
