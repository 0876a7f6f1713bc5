"""What every service's tables share: a schema of their own and one naming convention for
constraints and indexes, so migrations and models agree on every name."""

from __future__ import annotations

from typing import Any

from sqlalchemy import MetaData
from sqlalchemy.dialects.postgresql import DOMAIN
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.operators import OperatorClass
from sqlalchemy.types import TypeEngine

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def metadata_for(schema: str) -> MetaData:
    return MetaData(schema=schema, naming_convention=NAMING)


class Domain(DOMAIN):
    """A PostgreSQL domain that SQLAlchemy compares, binds and reads as its base type.
    SQLAlchemy's own ``DOMAIN`` knows only its DDL: a column of it takes no operator of
    its base type (``state == 'x'`` warns), and a ``JSONB`` one would not bind a dict."""

    cache_ok = True

    def __getattr__(self, key: str) -> Any:
        # what the base type's operators read of it (``JSONB.astext_type``)
        if key == "data_type":
            raise AttributeError(key)
        return getattr(self.data_type, key)

    @property
    def operator_classes(self) -> OperatorClass:  # type: ignore[override]
        return self.data_type.operator_classes

    @property
    def comparator_factory(self) -> Any:  # type: ignore[override]
        return self.data_type.comparator_factory

    def coerce_compared_value(self, op: Any, value: Any) -> TypeEngine[Any]:
        return self.data_type.coerce_compared_value(op, value)

    def bind_processor(self, dialect: Dialect) -> Any:
        return self.data_type.dialect_impl(dialect).bind_processor(dialect)

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        return self.data_type.dialect_impl(dialect).result_processor(dialect, coltype)
