"""What every service's tables share: a schema of their own and one naming convention for
constraints and indexes, so migrations and models agree on every name."""

from __future__ import annotations

from sqlalchemy import MetaData

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def metadata_for(schema: str) -> MetaData:
    return MetaData(schema=schema, naming_convention=NAMING)
