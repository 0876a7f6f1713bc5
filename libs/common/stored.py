"""What an answer shows of a request model it stored: ``Stored[Artifact]``.

A service stores what a request gave and shows it again in its answers (a task's artifact,
a schedule's target, a workflow's definition). Input bounds tighten over time (a digest
in lower case only, a JSON rule, a narrower range), and a row stored under the looser
rules must still be shown: an answer that validated it with the request model was a 500
for the row's every reader, and a client that read it so could not read the answer.

``Stored[M]`` is ``M`` to a type checker and, to pydantic, ``M``'s stored form: the same
fields, names, defaults and descriptions, with every bound and rule of ``M`` left out
(string patterns and lengths, ranges, list and map sizes, validators) and each request
model inside it in its stored form too; fields it does not know are ignored, as in every
answer. The fields are written once, in the request model; only the checks differ.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, Field, GetCoreSchemaHandler, SerializeAsAny, create_model
from pydantic.fields import FieldInfo
from pydantic.functional_validators import (
    AfterValidator,
    BeforeValidator,
    PlainValidator,
    WrapValidator,
)
from pydantic.types import StringConstraints
from pydantic_core import CoreSchema, PydanticUndefined, core_schema

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)

# What a stored form leaves out of a type's Annotated metadata: its bounds and rules.
_RULES = (
    StringConstraints,
    annotated_types.BaseMetadata,
    annotated_types.GroupedMetadata,
    AfterValidator,
    BeforeValidator,
    PlainValidator,
    WrapValidator,
)


def is_request_model(tp: Any) -> bool:
    """A model that refuses unknown fields: a request's (``Input``, ``SecretRef``)."""
    return (
        isinstance(tp, type)
        and issubclass(tp, BaseModel)
        and tp.model_config.get("extra") == "forbid"
    )


def loose(tp: Any) -> Any:
    """``tp`` without the bounds and rules in it, each request model in it stored."""
    if is_request_model(tp):
        return stored(tp)
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        kept = [m for m in map(_kept, meta) if m is not None]
        return Annotated[(loose(base), *kept)] if kept else loose(base)
    args = get_args(tp)
    if origin is None or origin is typing.Literal or not args:
        return tp
    inner = tuple(loose(a) for a in args)
    if origin in (Union, types.UnionType):
        return Union[inner]  # noqa: UP007 - built from a tuple
    return origin[inner]


def _kept(meta: Any) -> Any:
    """What of one Annotated item a stored form keeps (None: nothing)."""
    if isinstance(meta, _RULES):
        return None
    if isinstance(meta, FieldInfo):
        keep = {"discriminator": meta.discriminator, "description": meta.description}
        given = {k: v for k, v in keep.items() if v is not None}
        return Field(**given) if given else None  # type: ignore[call-overload]
    return meta


def _field(info: FieldInfo) -> FieldInfo:
    """A field as its stored form has it: its default, description and what leaves it
    out of an answer; none of its bounds."""
    given: dict[str, Any] = {
        "description": info.description,
        "exclude_if": info.exclude_if,
        "alias": info.alias,
        "discriminator": info.discriminator,
    }
    given = {k: v for k, v in given.items() if v is not None}
    factory = info.default_factory
    if factory is not None:
        model = typing.cast(type[BaseModel], factory)
        given["default_factory"] = stored(model) if is_request_model(factory) else factory
    elif info.default is not PydanticUndefined:
        default = info.default
        if is_request_model(type(default)):
            default = stored(type(default)).model_validate(default.model_dump())
        given["default"] = default
    return Field(**given)  # type: ignore[no-any-return]


_STORED: dict[type[BaseModel], type[BaseModel]] = {}


def stored(model: type[BaseModel]) -> type[BaseModel]:
    """The stored form of the request model ``model`` (made once)."""
    from libs.common.models import Output

    if model in _STORED:
        return _STORED[model]
    if not getattr(model, "__pydantic_fields_complete__", True):
        model.model_rebuild()
    fields: dict[str, Any] = {
        name: (loose(info.annotation), _field(info)) for name, info in model.model_fields.items()
    }
    made = _STORED[model] = create_model(
        f"Stored{model.__name__}",
        __base__=Output,
        __doc__=model.__doc__,
        __module__=model.__module__,
        **fields,
    )
    return made


def _as_data(value: Any) -> Any:
    """A request model's instance (what a service answers from the request it was given)
    as its data, which the stored form takes."""
    return value.model_dump() if is_request_model(type(value)) else value


def as_stored(model: type[_M], data: Any) -> _M:
    """``data`` validated as the stored form of ``model``, for a service that reads a
    stored row outside an answer model: a ``model`` to the type checker, whose fields
    it has (not its methods, not ``isinstance``)."""
    return typing.cast(_M, stored(model).model_validate(data))


class _AsStored:
    """Annotated metadata: validate and describe the type as its stored form."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_before_validator_function(
            _as_data, handler.generate_schema(loose(source))
        )


#: ``M`` as an answer shows it when stored (the module's docstring). Serialised as what
#: it holds: an answer built without validation (``model_construct``, from the request
#: itself) holds the request model's instance
Stored = Annotated[_T, _AsStored(), SerializeAsAny()]
