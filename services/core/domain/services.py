"""Services' declared ports and probes (docs/services.md): the rules a submission's
``service`` must hold beyond its shape, each refusal a 422 naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.domain.limits import refuse

PROBES = ("startup", "liveness", "readiness")


def check(service: Mapping[str, Any] | None, kind: str, field: str = "body.service") -> None:
    """Refuse a ``service`` on a plain task, a port name declared twice, two ports of one
    fixed number, and a probe that names a port the service did not declare."""
    if service is None:
        return
    if kind != "service":
        raise refuse(field, "only a task of kind service may declare ports and probes")
    names: set[str] = set()
    numbers: set[int] = set()
    for i, port in enumerate(service.get("ports") or []):
        if port["name"] in names:
            raise refuse(f"{field}.ports.{i}.name", f"port {port['name']!r} is declared twice")
        if port["port"] and port["port"] in numbers:
            raise refuse(f"{field}.ports.{i}.port", f"port {port['port']} is declared twice")
        names.add(port["name"])
        numbers.add(port["port"])
    for which in PROBES:
        probe = service.get(which) or {}
        for how in ("http", "tcp"):
            ref = (probe.get(how) or {}).get("port")
            if isinstance(ref, str) and ref not in names:
                raise refuse(
                    f"{field}.{which}.{how}.port",
                    f"no port named {ref!r} is declared (service.ports)",
                )
