"""Placement by label (docs/placement.md): the selectors a task requires of a worker's
labels and the ones it prefers, and how a service's replicas spread across a label.

A selector is one of a small, bounded set, as Kubernetes writes them:

    disk=ssd   disk==ssd   zone!=c   zone in (a,b)   zone notin (a,b)   gpu exists   gpu   !gpu

``!=`` and ``notin`` hold for a worker without the label, as in Kubernetes.

The claim tests the required ones in SQL on every row it reads, so a submission stores
them *compiled* (``compile_required``) against a worker's *facts* (``facts``): each label
``k=v`` is the facts ``"k=v"`` and ``"k"`` (a key holds no ``=``). A task's selectors are
then facts all required (``all``), facts none of which may be present (``none``), and
groups of which each needs one present (``any``, from ``in`` of several values): three
jsonb tests, no function per row (``db.attempts``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from libs.common.selectors import KEY, LABEL_KEY, MAX_VALUES, Op, Selector, parse
from services.core.domain.limits import refuse

__all__ = ["KEY", "MAX_VALUES", "Op", "Selector", "parse"]

#: the spread domain that is the worker's host (its registered hostname), not a label
HOST = "host"


def parse_all(texts: Sequence[str], field: str) -> list[Selector]:
    """Each of ``texts`` parsed; a 422 naming ``field`` and the item otherwise."""
    out = []
    for i, item in enumerate(texts):
        try:
            out.append(parse(item))
        except ValueError as exc:
            raise refuse(f"{field}.{i}", str(exc)) from None
    return out


# --- the claim's form --------------------------------------------------------------------


def facts(labels: Mapping[str, str]) -> list[str]:
    """A worker's labels as the facts the compiled selectors test."""
    return sorted({f"{k}={v}" for k, v in labels.items()} | set(labels))


def compile_required(selectors: Iterable[Selector]) -> dict[str, Any] | None:
    """The required selectors as the claim tests them; None when there are none (the
    claim's common case: one NULL test)."""
    every: set[str] = set()
    none: set[str] = set()
    groups: list[list[str]] = []
    for s in selectors:
        if s.op in ("=", "in"):
            wanted = sorted(f"{s.key}={v}" for v in s.values)
            if len(wanted) == 1:
                every.update(wanted)
            else:
                groups.append(wanted)
        elif s.op in ("!=", "notin"):
            none.update(f"{s.key}={v}" for v in s.values)
        elif s.op == "exists":
            every.add(s.key)
        else:
            none.add(s.key)
    if not (every or none or groups):
        return None
    return {"all": sorted(every), "none": sorted(none), "any": groups}


def satisfies(rule: Mapping[str, Any], facts: frozenset[str] | set[str]) -> bool:
    """Whether a worker's facts meet compiled required selectors (``compile_required``),
    as the claim's SQL tests them: all present, none of ``none``, one of each group."""
    return (
        all(f in facts for f in rule.get("all", ()))
        and not any(f in facts for f in rule.get("none", ()))
        and all(any(f in facts for f in group) for group in rule.get("any", ()))
    )


def matches(required: Sequence[Selector], labels: Mapping[str, str]) -> bool:
    return all(s.matches(labels) for s in required)


def unmatched(required: Sequence[Selector], workers: Sequence[Mapping[str, str]]) -> str | None:
    """Why no worker among ``workers`` (their labels) meets ``required``, naming the
    selector(s); None when one does."""
    if any(matches(required, labels) for labels in workers):
        return None
    alone = [s for s in required if not any(s.matches(labels) for labels in workers)]
    if alone:
        return "no live worker matches " + ", ".join(str(s) for s in alone)
    return "no live worker matches all of " + ", ".join(str(s) for s in required)


def score(preferred: Sequence[tuple[Selector, int]], labels: Mapping[str, str]) -> int:
    """The weights of the preferred selectors a worker's labels meet."""
    return sum(weight for s, weight in preferred if s.matches(labels))


# --- spread ------------------------------------------------------------------------------


def domain_of(by: str, hostname: str, labels: Mapping[str, str]) -> str | None:
    """A worker's domain of a spread: its host, or its value of the label ``by`` (None:
    it has none, and takes no replica spread by it)."""
    return hostname if by == HOST else labels.get(by)


def spread_allows(mine: str | None, counts: Mapping[str, int], max_skew: int) -> bool:
    """Whether one more replica in domain ``mine`` keeps the group within ``max_skew``
    of the emptiest domain (``counts``: the group's running replicas in each domain of
    the eligible live workers, zeros included), as Kubernetes' topology spread."""
    if mine is None:
        return False
    floor = min(counts.values(), default=0)
    return counts.get(mine, 0) + 1 - floor <= max_skew


def check_key(key: str, field: str) -> str:
    if not LABEL_KEY.match(key):
        raise refuse(field, f"{key!r} is not a label key (letters, digits and _.-/)")
    return key


@dataclass(frozen=True)
class Rules:
    """A task's placement, parsed: what the claim tests and orders by."""

    required: tuple[Selector, ...] = ()
    preferred: tuple[tuple[Selector, int], ...] = ()
    #: (label or ``host``, max skew); anti-affinity is a skew of none: (label, 0)
    spread: tuple[str, int] | None = None

    @property
    def compiled(self) -> dict[str, Any] | None:
        return compile_required(self.required)


def rules_of(placement: Mapping[str, Any] | None, field: str = "placement") -> Rules:
    """A placement (as ``libs.common.models.Placement`` dumps it) parsed and checked; a
    422 naming the field within ``field`` and the reason otherwise."""
    if not placement:
        return Rules()
    required = parse_all(placement.get("required") or [], f"{field}.required")
    preferred = []
    for i, item in enumerate(placement.get("preferred") or []):
        try:
            preferred.append((parse(item["selector"]), int(item.get("weight", 1))))
        except ValueError as exc:
            raise refuse(f"{field}.preferred.{i}.selector", str(exc)) from None
    spread, anti = placement.get("spread"), placement.get("anti_affinity")
    if spread and anti:
        raise refuse(f"{field}.anti_affinity", "give spread or anti_affinity, not both")
    by = None
    if spread:
        by = (check_key(spread["by"], f"{field}.spread.by"), int(spread.get("max_skew", 1)))
    elif anti:
        by = (check_key(anti, f"{field}.anti_affinity"), 0)
    return Rules(tuple(required), tuple(preferred), by)


def spread_allows_one(rules: Rules, mine: str | None, counts: Mapping[str, int]) -> bool:
    """Whether a worker of domain ``mine`` may take one more of the group, by the
    task's spread or anti-affinity (``counts``: its running ones per domain)."""
    if rules.spread is None:
        return True
    _, skew = rules.spread
    if skew == 0:
        return mine is not None and counts.get(mine, 0) == 0
    return spread_allows(mine, counts, skew)
