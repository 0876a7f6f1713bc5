"""Fire times across time zones and DST changes (services/cron/domain/timing.py)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cron.domain import timing
from services.cron.domain.timing import InvalidSchedule

NY = ZoneInfo("America/New_York")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def local(at: datetime) -> str:
    return at.astimezone(NY).strftime("%Y-%m-%d %H:%M %Z")


def test_daily_0230_across_spring_forward_fires_once_a_day() -> None:
    got = timing.fires_between("30 2 * * *", NY, utc(2027, 3, 12), utc(2027, 3, 17), 100)
    assert [local(t) for t in got] == [
        "2027-03-12 02:30 EST",
        "2027-03-13 02:30 EST",
        # 02:30 does not exist on 14 March: it fires at 02:30 standard time = 03:30 EDT.
        "2027-03-14 03:30 EDT",
        "2027-03-15 02:30 EDT",
        "2027-03-16 02:30 EDT",
    ]


def test_daily_0230_across_fall_back_fires_once_a_day() -> None:
    got = timing.fires_between("30 2 * * *", NY, utc(2027, 11, 5), utc(2027, 11, 10), 100)
    assert [local(t) for t in got] == [
        "2027-11-05 02:30 EDT",
        "2027-11-06 02:30 EDT",
        "2027-11-07 02:30 EST",
        "2027-11-08 02:30 EST",
        "2027-11-09 02:30 EST",
    ]


def test_daily_0130_on_fall_back_fires_at_the_first_occurrence_only() -> None:
    got = timing.fires_between("30 1 * * *", NY, utc(2027, 11, 6, 12), utc(2027, 11, 8), 100)
    assert [local(t) for t in got] == ["2027-11-07 01:30 EDT"]


def test_every_15_minutes_1_to_3_across_fall_back_fires_twelve_times() -> None:
    day = timing.fires_between("*/15 1-3 * * *", NY, utc(2027, 11, 7, 4), utc(2027, 11, 7, 12), 100)
    walls = [t.astimezone(NY).strftime("%H:%M") for t in day]
    assert walls == [f"{h:02d}:{m:02d}" for h in (1, 2, 3) for m in (0, 15, 30, 45)]
    assert len(day) == len(set(day)) == 12
    # The repeated hour 01:00-01:59 fires in its first pass (EDT) only.
    assert {local(t)[-3:] for t in day[:4]} == {"EDT"}


def test_every_15_minutes_1_to_3_across_spring_forward_fires_once_per_instant() -> None:
    day = timing.fires_between("*/15 1-3 * * *", NY, utc(2027, 3, 14, 4), utc(2027, 3, 14, 12), 100)
    # 02:00-02:45 do not exist; they map onto 03:00-03:45 EDT, which fire once each.
    assert [local(t)[11:] for t in day] == [
        "01:00 EST", "01:15 EST", "01:30 EST", "01:45 EST",
        "03:00 EDT", "03:15 EDT", "03:30 EDT", "03:45 EDT",
    ]  # fmt: skip


def test_next_after_is_strictly_after_even_inside_the_repeated_hour() -> None:
    # 01:20 EST is the second pass of 01:20 on fall-back day. 01:30 fired in the first
    # pass (EDT) and the second pass repeats nothing, so the next fire is 02:00 EST.
    after = datetime(2027, 11, 7, 1, 20, tzinfo=NY, fold=1).astimezone(UTC)
    nxt = timing.next_after("*/15 * * * *", NY, after)
    assert nxt is not None
    assert nxt > after
    assert local(nxt) == "2027-11-07 02:00 EST"


def test_an_expression_that_never_fires_has_no_next_and_returns_quickly() -> None:
    assert timing.next_after("59 23 31 2 *", ZoneInfo("UTC"), utc(2027, 1, 1)) is None
    assert timing.fires_between("59 23 31 2 *", NY, utc(2027, 1, 1), utc(2030, 1, 1), 5) == []


@pytest.mark.parametrize("expression", ["* * * * *", "0 0 1 1 *", "59 23 31 12 *"])
@pytest.mark.parametrize("zone", ["UTC", "Pacific/Kiritimati", "America/New_York"])
def test_the_calendars_last_day_has_no_next_fire_past_it(expression: str, zone: str) -> None:
    """A walk past 9999-12-31 (in UTC or the zone's wall clock) ends with no fire; it
    raised, and a schedule starting then was a 500."""
    for after in (utc(9999, 12, 31, 23, 59), utc(9999, 12, 31, 12), utc(9999, 12, 30)):
        found = timing.next_after(expression, ZoneInfo(zone), after)
        assert found is None or after < found < utc(9999, 12, 31, 23, 59, 59)


def test_latest_between_walks_back_from_the_end() -> None:
    got = timing.latest_between("0 * * * *", NY, utc(2027, 1, 1), utc(2027, 1, 8, 0, 30), 3)
    assert got == [utc(2027, 1, 7, 22), utc(2027, 1, 7, 23), utc(2027, 1, 8, 0)]
    assert timing.latest_between("0 * * * *", NY, utc(2027, 1, 7, 23), utc(2027, 1, 8), 10) == [
        utc(2027, 1, 8)
    ]


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("", "empty"),
        ("* * * *", "has 4 fields"),
        ("* * * * * *", "has 6 fields"),
        ("61 * * * *", "not a valid"),
        ("@reboot", "unknown macro"),
        ("x" * 300, "longer than"),
        # croniter drew these afresh at each reading: each next fire was another minute
        ("R * * * *", "random"),
        ("0 0 R(1-5) * *", "random"),
        ("0 r/2 * * *", "random"),
    ],
)
def test_bad_expressions_say_why(expression: str, reason: str) -> None:
    with pytest.raises(InvalidSchedule, match=reason):
        timing.parse_expression(expression)


def test_month_and_day_names_are_not_taken_for_random() -> None:
    assert timing.parse_expression("0 9 * mar,apr fri") == "0 9 * mar,apr fri"


def test_macros_and_spacing_are_normalised() -> None:
    assert timing.parse_expression("@Daily") == "@daily"
    assert timing.parse_expression(" 0   3 * * 1-5 ") == "0 3 * * 1-5"


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "../etc/passwd", "/etc/localtime"])
def test_bad_zones_are_refused(zone: str) -> None:
    with pytest.raises(InvalidSchedule, match="IANA"):
        timing.parse_zone(zone)


ZONES = ["UTC", "America/New_York", "Europe/London", "Australia/Lord_Howe", "Asia/Kolkata"]
EXPRESSIONS = ["*/7 * * * *", "30 2 * * *", "0 */3 * * *", "15,45 1-3 * * 0", "@hourly"]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(EXPRESSIONS),
    st.sampled_from(ZONES),
    st.datetimes(min_value=datetime(2026, 1, 1), max_value=datetime(2030, 1, 1)),
)
def test_fires_increase_strictly_and_agree_with_walking_back(
    expression: str, zone_name: str, start: datetime
) -> None:
    zone = ZoneInfo(zone_name)
    after = start.replace(tzinfo=UTC)
    until = after + timedelta(days=3)
    forward = timing.fires_between(expression, zone, after, until, 10_000)
    assert all(a < b for a, b in itertools.pairwise(forward))
    assert all(after < t <= until for t in forward)
    assert timing.latest_between(expression, zone, after, until, 5) == forward[-5:]
