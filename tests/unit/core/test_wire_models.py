"""Core's wire format has one home: every body core's HTTP API takes or answers is a
model of ``libs.common.models`` (CONVENTIONS: wire models in one place), or the stored
form of one (``libs.common.stored``: its fields, without its bounds), its states the one
enum of ``libs.common.states``."""

from __future__ import annotations

from pathlib import Path

from libs.common import models, states
from libs.common.stored import is_request_model, stored
from services.core.app import create_app
from services.core.settings import CoreSettings

# Schemas pydantic itself supplies, not Cairn's.
PYDANTIC_OWN = {"JsonValue"}
HOMES = {models.__name__, states.__name__}


def _home(name: str) -> str | None:
    """The module of the model a schema is named after; for a stored form (``StoredX``),
    of the request model ``X`` it is derived from."""
    model = getattr(models, name, None)
    if model is None and name.startswith("Stored"):
        model = getattr(models, name.removeprefix("Stored"), None)
        if not is_request_model(model) or stored(model).__name__ != name:
            return None
    return getattr(model, "__module__", None)


def test_every_schema_of_cores_api_is_a_model_of_libs_common_models(tmp_path: Path) -> None:
    config = CoreSettings(home=tmp_path, database_url="postgresql://cairn@127.0.0.1/unused")
    schemas = create_app(config, config.database_url or "").openapi()["components"]["schemas"]
    elsewhere = sorted(name for name in set(schemas) - PYDANTIC_OWN if _home(name) not in HOMES)
    assert elsewhere == []
    assert {"Subscription", "NotificationEvent", "DeliveryList", "StoredArtifact"} <= set(schemas)
