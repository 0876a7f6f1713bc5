"""Alembic environment of the DAG service's schema; the URL comes from the caller's config."""

from libs.common.migrations import run_online
from services.dag.tables import SCHEMA, metadata

run_online(SCHEMA, metadata)
