"""The HTTP API as a contract: the OpenAPI documents of core, cron and dag kept in
docs/openapi/, and the rules that say which change to ``/v1`` breaks a client (docs/api.md).

Regenerate the stored documents after a change to the API:

    PYTHONPATH=$PWD .venv/bin/python -m tests.openapi_contract --write

Without ``--write`` it compares and exits 1 when a document is stale or broken.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI

STORED = Path(__file__).resolve().parent.parent / "docs" / "openapi"
PREFIX = "/v1/"
REGENERATE = "python -m tests.openapi_contract --write"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
# A placeholder: building the schema opens no connection.
_UNUSED_DB = "postgresql://cairn@127.0.0.1/unused"

Schema = dict[str, Any]


def _core() -> FastAPI:
    from services.core.app import create_app
    from services.core.settings import CoreSettings

    return create_app(CoreSettings(database_url=_UNUSED_DB), _UNUSED_DB)


def _cron() -> FastAPI:
    from services.cron.app import create_app
    from services.cron.settings import CronSettings

    return create_app(CronSettings(database_url=_UNUSED_DB), _UNUSED_DB)


def _dag() -> FastAPI:
    from services.dag.app import create_app
    from services.dag.settings import DagSettings

    return create_app(DagSettings(database_url=_UNUSED_DB), _UNUSED_DB)


SERVICES: dict[str, Callable[[], FastAPI]] = {"core": _core, "cron": _cron, "dag": _dag}


def current(service: str) -> Schema:
    """The document ``service`` serves at /openapi.json, built without a database."""
    document: Schema = SERVICES[service]().openapi()
    return document


def stored(service: str) -> Schema | None:
    path = STORED / f"{service}.json"
    return json.loads(path.read_text()) if path.exists() else None


def render(document: Schema) -> str:
    """The stored form: sorted keys, two-space indent, one newline at the end."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def major(document: Schema) -> int:
    """The major number of ``info.version`` (MAJOR.MINOR.PATCH)."""
    return int(str(document["info"]["version"]).split(".")[0])


def version_moved(old: Schema, new: Schema) -> bool:
    """Whether a breaking change is announced: the major number of the version rose."""
    return major(new) > major(old)


def breaking_changes(old: Schema, new: Schema) -> list[str]:
    """What in ``new`` breaks a client written against ``old``, on the ``/v1`` paths:
    a removed path, method, parameter or field; a newly required parameter or request
    field; a removed enum value; a request type narrowed or a response type widened; a
    response field no longer always present."""
    found: list[str] = []
    for path, operations in sorted(old.get("paths", {}).items()):
        if not path.startswith(PREFIX):
            continue
        now = new.get("paths", {}).get(path)
        if now is None:
            found.append(f"{path}: path removed")
            continue
        for method in METHODS:
            if method in operations:
                where = f"{method.upper()} {path}"
                if method not in now:
                    found.append(f"{where}: method removed")
                    continue
                found += _operation(where, operations[method], now[method], old, new)
    return found


def _operation(where: str, old_op: Schema, new_op: Schema, old: Schema, new: Schema) -> list[str]:
    found = _parameters(where, old_op, new_op, old, new)
    old_body = _json_schema(old_op.get("requestBody"))
    new_body = _json_schema(new_op.get("requestBody"))
    if new_body is not None:
        newly = new_op["requestBody"].get("required") and not (old_op.get("requestBody") or {}).get(
            "required"
        )
        if newly:
            found.append(f"{where}: request body newly required")
        if old_body is not None:
            found += _compare(f"{where} request", old_body, new_body, old, new, request=True)
    elif old_body is not None:
        found.append(f"{where}: request body removed")
    for status, response in sorted(old_op.get("responses", {}).items()):
        if not status.startswith("2"):
            continue
        new_response = new_op.get("responses", {}).get(status)
        if new_response is None:
            found.append(f"{where}: response {status} removed")
            continue
        before, after = _json_schema(response), _json_schema(new_response)
        if before is not None and after is not None:
            label = f"{where} response {status}"
            found += _compare(label, before, after, old, new, request=False)
    return found


def _parameters(where: str, old_op: Schema, new_op: Schema, old: Schema, new: Schema) -> list[str]:
    def by_key(operation: Schema) -> dict[tuple[str, str], Schema]:
        return {(p["in"], p["name"]): p for p in operation.get("parameters", [])}

    before, after = by_key(old_op), by_key(new_op)
    found = []
    for key, parameter in sorted(after.items()):
        was = before.get(key)
        label = f"{where}: {key[0]} parameter {key[1]!r}"
        if parameter.get("required") and not (was or {}).get("required"):
            found.append(f"{label} newly required")
        if was is not None:
            found += _compare(
                label, was.get("schema", {}), parameter.get("schema", {}), old, new, request=True
            )
    found += [
        f"{where}: {k[0]} parameter {k[1]!r} removed" for k in sorted(set(before) - set(after))
    ]
    return found


def _json_schema(part: Schema | None) -> Schema | None:
    if not part:
        return None
    content = part.get("content", {})
    for media, body in sorted(content.items()):
        if media.endswith("json") and "schema" in body:
            shape: Schema = body["schema"]
            return shape
    return None


def _alternatives(
    schema: Schema, document: Schema, seen: frozenset[str] = frozenset()
) -> Iterator[Schema]:
    """The shapes ``schema`` allows, ``$ref``s resolved and ``anyOf``/``oneOf`` flattened."""
    ref = schema.get("$ref")
    if ref is not None:
        if ref in seen:
            return
        target = document
        for part in ref.removeprefix("#/").split("/"):
            target = target.get(part, {})
        yield from _alternatives(target, document, seen | {ref})
        return
    choices = schema.get("anyOf") or schema.get("oneOf")
    if choices is None and len(schema.get("allOf", [])) == 1:
        choices = schema["allOf"]
    if choices is None:
        yield schema
        return
    for choice in choices:
        yield from _alternatives(choice, document, seen)


def _types(shapes: list[Schema]) -> set[str]:
    kinds: set[str] = set()
    for shape in shapes:
        kind = shape.get("type")
        if kind is None:
            kind = "object" if "properties" in shape else "any"
        kinds |= set(kind) if isinstance(kind, list) else {kind}
    if "number" in kinds:
        kinds.add("integer")
    return kinds


def _enum(shapes: list[Schema]) -> set[str] | None:
    """The values allowed, or None when any value of the type is."""
    values: set[str] = set()
    for shape in shapes:
        if "const" in shape:
            values.add(json.dumps(shape["const"]))
        elif "enum" in shape:
            values |= {json.dumps(v) for v in shape["enum"]}
        elif shape.get("type") != "null":
            return None
    return values


def _properties(shapes: list[Schema]) -> tuple[dict[str, Schema], set[str]]:
    """Properties of the object shapes, merged; the names every object shape requires."""
    merged: dict[str, list[Schema]] = {}
    required: set[str] | None = None
    for shape in shapes:
        if "properties" not in shape:
            continue
        for name, sub in shape["properties"].items():
            merged.setdefault(name, []).append(sub)
        names = set(shape.get("required", []))
        required = names if required is None else required & names
    properties = {k: v[0] if len(v) == 1 else {"anyOf": v} for k, v in merged.items()}
    return properties, required or set()


def _compare(
    where: str,
    before: Schema,
    after: Schema,
    old: Schema,
    new: Schema,
    *,
    request: bool,
    depth: int = 0,
) -> list[str]:
    if depth > 12:  # a recursive schema: compared deep enough
        return []
    was, now = list(_alternatives(before, old)), list(_alternatives(after, new))
    found = _values(where, was, now, request=request)

    def deeper(label: str, before: Schema, after: Schema) -> list[str]:
        return _compare(label, before, after, old, new, request=request, depth=depth + 1)

    old_props, old_required = _properties(was)
    new_props, new_required = _properties(now)
    for name, sub in sorted(old_props.items()):
        if name not in new_props:
            found.append(f"{where}.{name}: field removed")
            continue
        if not request and name in old_required and name not in new_required:
            found.append(f"{where}.{name}: no longer always present")
        found += deeper(f"{where}.{name}", sub, new_props[name])
    if request:
        found += [f"{where}.{name}: newly required" for name in sorted(new_required - old_required)]
    for key, mark in (("items", "[]"), ("additionalProperties", "{}")):
        old_sub, new_sub = _merged(was, key), _merged(now, key)
        if old_sub is not None and new_sub is not None:
            found += deeper(where + mark, old_sub, new_sub)
    return found


def _values(where: str, was: list[Schema], now: list[Schema], *, request: bool) -> list[str]:
    """A request may take no less than before; an answer may hold no more (docs/api.md)."""
    found = []
    old_types, new_types = _types(was), _types(now)
    if "any" not in new_types:
        if request and not old_types <= new_types:
            found.append(f"{where}: type narrowed from {sorted(old_types)} to {sorted(new_types)}")
        if not request and "any" not in old_types and not new_types <= old_types:
            found.append(f"{where}: type widened from {sorted(old_types)} to {sorted(new_types)}")
    old_enum, new_enum = _enum(was), _enum(now)
    if old_enum is not None and new_enum is not None and old_enum - new_enum:
        found.append(f"{where}: enum value(s) removed: {', '.join(sorted(old_enum - new_enum))}")
    return found


def _merged(shapes: list[Schema], key: str) -> Schema | None:
    subs = [shape[key] for shape in shapes if isinstance(shape.get(key), dict)]
    if not subs:
        return None
    return subs[0] if len(subs) == 1 else {"anyOf": subs}


def unannounced(then: Schema, now: Schema) -> list[str]:
    """The breaking changes from ``then`` to ``now`` that no major version step announces,
    headed by a line that says so; empty when there are none."""
    breaking = breaking_changes(then, now)
    if not breaking or version_moved(then, now):
        return []
    versions = f"info.version {then['info']['version']} -> {now['info']['version']}"
    head = f"{len(breaking)} breaking change(s) to /v1 without a major version step ({versions})"
    return [head + "; see docs/api.md", *breaking]


def problems(service: str) -> list[str]:
    """Why the stored document of ``service`` cannot stand: breaking changes without a
    major version step, or a difference at all (the stored copy must be current)."""
    now, then = current(service), stored(service)
    if then is None:
        return [f"docs/openapi/{service}.json is missing: run `{REGENERATE}`"]
    if render(now) == render(then):
        return []
    breaking = unannounced(then, now)
    if breaking:
        return [f"{service}: {breaking[0]}", *breaking[1:]]
    return [f"docs/openapi/{service}.json differs from the API: run `{REGENERATE}`"]


def main(argv: list[str]) -> int:
    write = "--write" in argv
    failed = False
    for service in SERVICES:
        now, then = current(service), stored(service)
        # A breaking change is written only with its major version step.
        refused = unannounced(then, now) if then is not None else []
        if write and not refused:
            STORED.mkdir(parents=True, exist_ok=True)
            (STORED / f"{service}.json").write_text(render(now))
            continue
        for line in problems(service):
            failed = True
            sys.stderr.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
