"""Placement by label's rules (services/core/domain/selectors.py): each selector's text,
its meaning against labels, the compiled form the claim tests (checked here against the
selectors' own meaning), the reason naming what no worker matches, and the spread."""

from __future__ import annotations

import itertools

import pytest

from libs.common.errors import InvalidInput
from services.core.domain import selectors
from services.core.domain.selectors import Selector, parse


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("disk=ssd", Selector("disk", "=", ("ssd",))),
        ("disk == ssd", Selector("disk", "=", ("ssd",))),
        ("zone!=c", Selector("zone", "!=", ("c",))),
        ("zone in (a, b,a)", Selector("zone", "in", ("a", "b"))),
        ("zone notin (a)", Selector("zone", "notin", ("a",))),
        ("gpu exists", Selector("gpu", "exists")),
        ("gpu", Selector("gpu", "exists")),
        ("!gpu", Selector("gpu", "!exists")),
        ("topology.io/zone=eu-1", Selector("topology.io/zone", "=", ("eu-1",))),
    ],
)
def test_each_selector_form_parses(text: str, parsed: Selector) -> None:
    assert parse(text) == parsed
    assert parse(str(parsed)) == parsed


@pytest.mark.parametrize(
    "text", ["", "=ssd", "zone in a", "zone in ()", "zone in (a,,b)", "a b", "-x=1", "k=\x01"]
)
def test_what_is_not_a_selector_is_refused_with_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"selector|values"):
        parse(text)


def test_an_in_lists_a_bounded_number_of_values() -> None:
    values = ",".join(str(i) for i in range(selectors.MAX_VALUES + 1))
    with pytest.raises(ValueError, match="at most 16"):
        parse(f"zone in ({values})")


LABELS = [{}, {"zone": "a"}, {"zone": "c"}, {"zone": "a", "gpu": "1"}, {"disk": "ssd", "gpu": ""}]
TEXTS = ["zone=a", "zone!=c", "zone in (a,b)", "zone notin (a,c)", "gpu exists", "!gpu", "gpu="]


def test_the_compiled_form_means_what_the_selectors_mean() -> None:
    for n in (1, 2, 3):
        for chosen in itertools.combinations(TEXTS, n):
            required = [parse(t) for t in chosen]
            compiled = selectors.compile_required(required)
            assert compiled is not None
            for labels in LABELS:
                facts = set(selectors.facts(labels))
                by_sql = (
                    set(compiled["all"]) <= facts
                    and not set(compiled["none"]) & facts
                    and all(set(group) & facts for group in compiled["any"])
                )
                assert by_sql == selectors.matches(required, labels), (chosen, labels)
    assert selectors.compile_required([]) is None


def test_the_reason_names_the_selectors_no_worker_meets() -> None:
    fleet = [{"disk": "ssd", "zone": "a"}, {"disk": "hdd", "zone": "b"}]
    assert selectors.unmatched([parse("disk=ssd")], fleet) is None
    assert selectors.unmatched([parse("disk=nvme"), parse("zone=a")], fleet) == (
        "no live worker matches disk=nvme"
    )
    assert selectors.unmatched([parse("disk=ssd"), parse("zone=b")], fleet) == (
        "no live worker matches all of disk=ssd, zone=b"
    )


def test_a_spread_keeps_each_domain_within_the_skew_of_the_emptiest() -> None:
    assert selectors.spread_allows("a", {"a": 0, "b": 0}, 1)
    assert not selectors.spread_allows("a", {"a": 1, "b": 0}, 1)
    assert selectors.spread_allows("a", {"a": 1, "b": 0}, 2)
    assert not selectors.spread_allows(None, {"a": 0}, 5)  # no label: no domain
    anti = selectors.rules_of({"anti_affinity": "host"})
    assert selectors.spread_allows_one(anti, "h1", {"h2": 3})
    assert not selectors.spread_allows_one(anti, "h1", {"h1": 1})


def test_a_placement_is_checked_field_by_field() -> None:
    with pytest.raises(InvalidInput) as bad:
        selectors.rules_of({"required": ["disk=ssd", "zone in a"]}, "body.placement")
    assert bad.value.extra["errors"][0]["field"] == "body.placement.required.1"
    with pytest.raises(InvalidInput) as bad:
        selectors.rules_of({"spread": {"by": "zone"}, "anti_affinity": "host"}, "p")
    assert bad.value.extra["errors"][0]["field"] == "p.anti_affinity"
    rules = selectors.rules_of({"preferred": [{"selector": "zone=b", "weight": 5}]})
    assert selectors.score(rules.preferred, {"zone": "b"}) == 5
    assert selectors.score(rules.preferred, {"zone": "a"}) == 0
