"""The API as a contract (docs/api.md): the stored OpenAPI documents are the services'
own, and each rule of a breaking change is caught on documents FastAPI builds from small
apps, the way it builds the services'."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any, Literal

import pytest
from fastapi import FastAPI, Query
from pydantic import BaseModel

from tests import openapi_contract as contract
from tests.openapi_contract import breaking_changes, unannounced


@pytest.mark.parametrize("service", sorted(contract.SERVICES))
def test_the_stored_document_is_the_services_own(service: str) -> None:
    assert contract.problems(service) == []


def build(register: Callable[[FastAPI], Any], version: str = "1.0.0") -> dict[str, Any]:
    app = FastAPI(title="t", version=version)
    register(app)
    document: dict[str, Any] = app.openapi()
    return document


class Colour(StrEnum):
    red = "red"
    blue = "blue"


class Item(BaseModel):
    name: str
    size: int


class ItemLess(BaseModel):  # Item without its size
    name: str


class ItemMore(BaseModel):  # Item with one more optional field
    name: str
    size: int
    note: str | None = None


class Page(BaseModel):
    items: list[Item]


class PageLess(BaseModel):
    items: list[ItemLess]


def reads(model: type[BaseModel], path: str = "/v1/items") -> Callable[[FastAPI], None]:
    def register(app: FastAPI) -> None:
        @app.get(path, response_model=model)
        def read() -> Any: ...

    return register


def takes(model: type[BaseModel]) -> Callable[[FastAPI], None]:
    def write(body: Any) -> None: ...

    # The annotation is the class itself: a string (this module's __future__) would not resolve.
    write.__annotations__["body"] = model

    def register(app: FastAPI) -> None:
        app.post("/v1/items")(write)

    return register


BASE = build(reads(Item))


def test_the_same_document_breaks_nothing() -> None:
    assert breaking_changes(BASE, build(reads(Item))) == []


def test_a_removed_path_or_method_is_breaking() -> None:
    assert breaking_changes(BASE, build(reads(Item, "/v1/things"))) == ["/v1/items: path removed"]

    def post_only(app: FastAPI) -> None:
        @app.post("/v1/items")
        def write() -> None: ...

    assert breaking_changes(BASE, build(post_only)) == ["GET /v1/items: method removed"]


def test_paths_outside_v1_are_not_the_contract() -> None:
    assert breaking_changes(build(reads(Item, "/healthz")), build(reads(Item, "/readyz"))) == []


def test_a_removed_response_field_is_breaking_and_an_added_optional_one_is_not() -> None:
    assert breaking_changes(BASE, build(reads(ItemLess))) == [
        "GET /v1/items response 200.size: field removed"
    ]
    assert breaking_changes(BASE, build(reads(ItemMore))) == []


def test_a_field_removed_deep_inside_a_list_of_references_is_caught() -> None:
    assert breaking_changes(build(reads(Page)), build(reads(PageLess))) == [
        "GET /v1/items response 200.items[].size: field removed"
    ]


def test_a_response_field_that_may_now_be_null_is_breaking() -> None:
    class Maybe(BaseModel):
        name: str
        size: int | None

    assert breaking_changes(BASE, build(reads(Maybe))) == [
        "GET /v1/items response 200.size: type widened from ['integer'] to ['integer', 'null']"
    ]


def test_a_response_field_no_longer_always_present_is_breaking() -> None:
    class Sometimes(BaseModel):
        name: str
        size: int = 0

    assert breaking_changes(BASE, build(reads(Sometimes))) == [
        "GET /v1/items response 200.size: no longer always present"
    ]


def test_a_newly_required_request_field_is_breaking_and_an_optional_one_is_not() -> None:
    class Needs(BaseModel):
        name: str
        size: int
        owner: str

    assert breaking_changes(build(takes(Item)), build(takes(Needs))) == [
        "POST /v1/items request.owner: newly required"
    ]
    assert breaking_changes(build(takes(Item)), build(takes(ItemMore))) == []


def test_a_removed_request_field_is_breaking() -> None:
    # Cairn's models forbid unknown fields: a client still sending it gets a 422.
    assert breaking_changes(build(takes(Item)), build(takes(ItemLess))) == [
        "POST /v1/items request.size: field removed"
    ]


def test_a_removed_enum_value_is_breaking_and_an_added_one_in_a_request_is_not() -> None:
    class Paint(BaseModel):
        colour: Colour

    class RedOnly(BaseModel):
        colour: Literal["red"]

    class More(BaseModel):
        colour: Literal["red", "blue", "green"]

    assert breaking_changes(build(takes(Paint)), build(takes(RedOnly))) == [
        'POST /v1/items request.colour: enum value(s) removed: "blue"'
    ]
    assert breaking_changes(build(takes(Paint)), build(takes(More))) == []


def test_a_narrowed_request_type_is_breaking() -> None:
    class Either(BaseModel):
        key: int | str

    class Number(BaseModel):
        key: int

    assert breaking_changes(build(takes(Either)), build(takes(Number))) == [
        "POST /v1/items request.key: type narrowed from ['integer', 'string'] to ['integer']"
    ]


def test_a_newly_required_parameter_is_breaking_and_an_optional_one_is_not() -> None:
    def listing(required: bool) -> Callable[[FastAPI], None]:
        def register(app: FastAPI) -> None:
            if required:

                @app.get("/v1/items")
                def read(limit: int = Query(), after: str | None = None) -> None: ...

            else:

                @app.get("/v1/items")
                def read_optional(limit: int = 10) -> None: ...

        return register

    before, after = build(listing(False)), build(listing(True))
    assert breaking_changes(before, after) == [
        "GET /v1/items: query parameter 'limit' newly required"
    ]
    assert breaking_changes(after, before) == ["GET /v1/items: query parameter 'after' removed"]


def test_a_breaking_change_stands_only_with_a_major_version_step() -> None:
    broken = build(reads(ItemLess), version="1.4.0")
    stated = unannounced(BASE, broken)
    assert stated[0].startswith("1 breaking change(s) to /v1 without a major version step")
    assert stated[1:] == ["GET /v1/items response 200.size: field removed"]
    assert unannounced(BASE, build(reads(ItemLess), version="2.0.0")) == []


def test_an_additive_change_still_asks_for_the_stored_copy_to_be_regenerated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(contract.SERVICES, "core", lambda: _app(reads(ItemMore)))
    monkeypatch.setattr(contract, "stored", lambda service: BASE)
    assert contract.problems("core") == [
        f"docs/openapi/core.json differs from the API: run `{contract.REGENERATE}`"
    ]
    monkeypatch.setitem(contract.SERVICES, "core", lambda: _app(reads(ItemLess)))
    assert contract.problems("core")[0].startswith("core: 1 breaking change(s)")


def _app(register: Callable[[FastAPI], Any]) -> FastAPI:
    app = FastAPI(title="t", version="1.0.0")
    register(app)
    return app
