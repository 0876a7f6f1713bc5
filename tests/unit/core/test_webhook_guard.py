"""The webhooks' egress guard refuses every host of a database that fails over (a
multi-host URL), not only the first, and not none."""

from __future__ import annotations

import asyncio

from services.core.ops.notify import Webhooks
from services.core.settings import CoreSettings

CLUSTER = "postgresql://cairn@93.184.216.34:5432,93.184.216.40:5433/cairn"


def test_every_host_of_a_multi_host_url_is_refused() -> None:
    settings = CoreSettings(notify_allow_cidrs="93.184.216.0/24", database_url=CLUSTER)
    assert settings.database_url is not None
    webhooks = asyncio.run(Webhooks.of(None, settings, settings.database_url))  # type: ignore[arg-type]
    policy = webhooks.egress
    assert not policy.permits("93.184.216.34", 5432)
    assert not policy.permits("93.184.216.40", 5433)
    assert policy.permits("93.184.216.35", 443)  # opened on purpose
