"""A service does not print pydantic's false alarm about FastAPI's body parameters
(``serve.quiet_fastapi_aliases``): one "alias has no effect" warning per route with a body,
at its first request and in the OpenAPI document. Other warnings of that kind still show."""

from __future__ import annotations

import warnings

import pytest
from pydantic.warnings import UnsupportedFieldAttributeWarning

from libs.common import serve
from services.core.app import create_app
from services.core.settings import CoreSettings

_URL = "postgresql+psycopg://cairn:x@127.0.0.1:1/cairn"  # never connected to


def _alias_warnings(quiet: bool) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if quiet:
            serve.quiet_fastapi_aliases()
        create_app(CoreSettings(), _URL).openapi()
    return [
        str(w.message) for w in seen if issubclass(w.category, UnsupportedFieldAttributeWarning)
    ]


def test_core_with_the_filter_builds_its_routes_without_the_alarm() -> None:
    loud = _alias_warnings(quiet=False)
    if loud:  # pydantic 2.12 to 2.14 at least (a later one may drop the alarm)
        assert any("'alias' attribute with value 'offer'" in m for m in loud), loud[:3]
    assert _alias_warnings(quiet=True) == []


def test_another_attribute_warning_still_shows() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        serve.quiet_fastapi_aliases()
        warnings.warn(
            "The 'frozen' attribute with value True was provided to the `Field()` function, "
            "which has no effect in the context it was used.",
            UnsupportedFieldAttributeWarning,
            stacklevel=1,
        )
    assert [w.category for w in seen] == [UnsupportedFieldAttributeWarning]


@pytest.mark.parametrize("attribute", ["alias", "validation_alias", "serialization_alias"])
def test_each_alias_attribute_is_silenced(attribute: str) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        serve.quiet_fastapi_aliases()
        warnings.warn(
            f"The '{attribute}' attribute with value 'body' was provided to the `Field()` "
            "function, which has no effect in the context it was used.",
            UnsupportedFieldAttributeWarning,
            stacklevel=1,
        )
    assert seen == []
