"""Alembic environment of core's schema; the URL comes from the caller's config."""

from libs.common.migrations import run_online
from services.core.db.tables import SCHEMA, metadata

run_online(SCHEMA, metadata)
