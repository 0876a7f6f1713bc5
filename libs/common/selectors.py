"""The text of a placement selector (docs/placement.md), as Kubernetes writes them:

    disk=ssd   disk==ssd   zone!=c   zone in (a,b)   zone notin (a,b)   gpu exists   gpu   !gpu

One parser for every service: core reads a submission's selectors with it
(``services.core.domain.selectors``, which also compiles them for the claim), and the wire
model (``libs.common.models.Placement``) checks each one with it, so a schedule's or a
workflow's task with a selector that is not one is refused (422 naming it) when it is
defined, not when it fires.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Op = Literal["=", "!=", "in", "notin", "exists", "!exists"]

#: a label key, as workers register them (``libs.common.models.LabelKey``)
KEY = r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}"
_VALUE = r"[^\x00-\x1f\x7f,()\s]{1,256}"
_EQUALS = re.compile(rf"^({KEY})\s*(==|=|!=)\s*([^\x00-\x1f\x7f]{{0,256}})$")
_SET = re.compile(rf"^({KEY})\s+(in|notin)\s*\((.*)\)$")
_EXISTS = re.compile(rf"^({KEY})(?:\s+exists)?$")
_ABSENT = re.compile(rf"^!\s*({KEY})$")
LABEL_KEY = re.compile(rf"^{KEY}$")
#: values an ``in`` or ``notin`` may list
MAX_VALUES = 16


@dataclass(frozen=True)
class Selector:
    """One requirement on a worker's labels."""

    key: str
    op: Op
    values: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.op in ("=", "!="):
            return f"{self.key}{self.op}{self.values[0]}"
        if self.op in ("in", "notin"):
            return f"{self.key} {self.op} ({','.join(self.values)})"
        return self.key + " exists" if self.op == "exists" else "!" + self.key

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return value in self.values
        if self.op in ("!=", "notin"):
            return value not in self.values
        return (value is not None) == (self.op == "exists")


def parse(text: str) -> Selector:
    """A selector from its text; ``ValueError`` saying what is wrong."""
    text = text.strip()
    if m := _SET.match(text):
        values = tuple(v.strip() for v in m[3].split(","))
        if not all(re.fullmatch(_VALUE, v) for v in values):
            raise ValueError(f"{text!r}: {m[2]} needs a list of values, as in {m[1]} {m[2]} (a,b)")
        if len(values) > MAX_VALUES:
            raise ValueError(f"{text!r}: at most {MAX_VALUES} values")
        op: Op = "in" if m[2] == "in" else "notin"
        return Selector(m[1], op, tuple(dict.fromkeys(values)))
    if m := _EQUALS.match(text):
        return Selector(m[1], "!=" if m[2] == "!=" else "=", (m[3].strip(),))
    if m := _EXISTS.match(text):
        return Selector(m[1], "exists")
    if m := _ABSENT.match(text):
        return Selector(m[1], "!exists")
    raise ValueError(
        f"{text!r} is not a selector: write key=value, key!=value, key in (a,b), "
        "key notin (a,b), key exists or !key (a key is letters, digits and _.-/)"
    )
