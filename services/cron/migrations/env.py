"""Alembic environment of the cron schema; the URL comes from the caller's config."""

from libs.common.migrations import run_online
from services.cron.tables import SCHEMA, metadata

run_online(SCHEMA, metadata)
