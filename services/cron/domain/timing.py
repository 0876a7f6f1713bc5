"""When a schedule fires: cron expressions read in a time zone's wall clock, mapped to
instants. Pure functions, no I/O.

The rule, documented in docs/cron.md: an expression names wall-clock times in the
schedule's zone, and each such time fires once.

- A wall-clock time the zone skips (spring forward) fires at the instant it would have had
  with the offset in force before the jump: a daily 02:30 in America/New_York fires at
  03:30 EDT on the day the clock jumps from 02:00 to 03:00. When that instant is also a
  real wall-clock time of the expression, it fires once.
- A wall-clock time the zone repeats (fall back) fires at its first occurrence only.

croniter walks naive wall-clock times; this module maps them to instants (``fold=0``, the
first occurrence, and the pre-jump offset inside a gap) and keeps the fire times strictly
increasing.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

MACROS = frozenset(
    {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
)
MAX_EXPRESSION = 200
# Around a time-zone transition, naive wall-clock order and instant order can differ by
# the size of the jump; candidates this far past the first are also looked at there.
_TRANSITION_WINDOW = timedelta(hours=3)
_ONE_US = timedelta(microseconds=1)
#: croniter's random field item: ``R``, ``R(0-29)``, ``R/5`` (month and day names never
#: start so)
_RANDOM = re.compile(r"^r(\(|/|$)", re.IGNORECASE)


class InvalidSchedule(ValueError):
    """An expression or zone that cannot be used; the message says why."""


def parse_expression(expression: str) -> str:
    """``expression`` normalised (single spaces), or InvalidSchedule saying what is wrong.
    Five fields (minute hour day-of-month month day-of-week) or one of the macros."""
    text = " ".join(expression.split())
    if not text:
        raise InvalidSchedule("the expression is empty")
    if len(text) > MAX_EXPRESSION:
        raise InvalidSchedule(f"the expression is longer than {MAX_EXPRESSION} characters")
    if text.startswith("@"):
        if text.lower() not in MACROS:
            raise InvalidSchedule(f"unknown macro {text!r}; use one of {', '.join(sorted(MACROS))}")
        return text.lower()
    fields = text.split(" ")
    if len(fields) != 5:
        raise InvalidSchedule(
            f"{text!r} has {len(fields)} fields; a cron expression has 5 "
            "(minute hour day-of-month month day-of-week)"
        )
    if any(_RANDOM.match(item) for field in fields for item in field.split(",")):
        # croniter draws R afresh each time it is read: every next fire (the engine's,
        # a preview's, another replica's) would be another minute
        raise InvalidSchedule(f"{text!r} uses R (random), which gives no fixed fire times")
    try:
        croniter(text)
    except (CroniterBadCronError, ValueError, KeyError) as exc:
        raise InvalidSchedule(f"{text!r} is not a valid cron expression: {exc}") from None
    return text


# Names the tz database ships that are not a place's clock: the host's own time
# (``localtime``; ``posixrules``, the rules a POSIX TZ string borrows), on which cron's
# replicas on different hosts need not agree, and ``Factory`` (no zone: "-00").
HOST_ZONES = frozenset({"localtime", "posixrules", "Factory"})


def check_new_zone(name: str) -> None:
    """InvalidSchedule for a zone that a schedule being set may not take (``HOST_ZONES``;
    ``parse_zone`` reads them still, so a schedule stored under one keeps firing)."""
    if name.removeprefix("posix/") in HOST_ZONES:
        raise InvalidSchedule(
            f"{name!r} is not a place's time zone (the host's own clock or none);"
            " name an IANA zone such as 'Europe/Paris' or 'UTC'"
        )


def parse_zone(name: str) -> ZoneInfo:
    """The IANA zone ``name``, or InvalidSchedule."""
    if not name or len(name) > 64 or name.startswith(("/", ".")) or ".." in name:
        raise InvalidSchedule(f"{name!r} is not an IANA time zone")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule(f"{name!r} is not an IANA time zone") from None


def _instant(naive: datetime, zone: ZoneInfo) -> datetime:
    """The instant of wall-clock time ``naive`` in ``zone``: first occurrence when repeated,
    the pre-jump offset when skipped."""
    return naive.replace(tzinfo=zone, fold=0).astimezone(UTC)


def _near_transition(naive: datetime, zone: ZoneInfo) -> bool:
    before = (naive - _TRANSITION_WINDOW).replace(tzinfo=zone).utcoffset()
    after = (naive + _TRANSITION_WINDOW).replace(tzinfo=zone).utcoffset()
    return before != after


def next_after(expression: str, zone: ZoneInfo, after: datetime) -> datetime | None:
    """The first fire strictly after the instant ``after`` (UTC), or None if there is none
    within croniter's search horizon or before the calendar ends (year 9999: a
    ``starts_at`` of its last day must not break the walk)."""
    best: datetime | None = None
    horizon: datetime | None = None
    try:
        start = after.astimezone(zone).replace(tzinfo=None)
        # One hour back: inside a repeated hour the naive time of ``after`` is its second
        # occurrence, and fires skipped in a gap map one hour later than their wall time.
        back = timedelta(hours=1) if _near_transition(start, zone) else timedelta(0)
        walker = croniter(expression, start - back)
        for _ in range(100_000):
            naive: datetime = walker.get_next(datetime)
            if horizon is not None and naive > horizon:
                break
            at = _instant(naive, zone)
            if at <= after:
                continue
            if best is None or at < best:
                best = at
            if horizon is None:
                if not _near_transition(naive, zone):
                    break
                horizon = naive + _TRANSITION_WINDOW
    except (OverflowError, ValueError):  # past croniter's horizon (CroniterBadDateError) or 9999
        pass
    return best


def fires(expression: str, zone: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """Every fire strictly after ``after``, in order, without end (or until none is left)."""
    at: datetime | None = after
    while at is not None:
        at = next_after(expression, zone, at)
        if at is not None:
            yield at


def fires_between(
    expression: str, zone: ZoneInfo, after: datetime, until: datetime, limit: int
) -> list[datetime]:
    """At most ``limit`` fires in ``(after, until]``, oldest first."""
    found: list[datetime] = []
    for at in fires(expression, zone, after):
        if at > until or len(found) >= limit:
            break
        found.append(at)
    return found


def latest_between(
    expression: str, zone: ZoneInfo, after: datetime, until: datetime, limit: int
) -> list[datetime]:
    """The newest ``limit`` fires in ``(after, until]``, oldest first, found by walking
    back from ``until`` (so a long gap costs ``limit`` steps, not one per missed fire)."""
    if limit <= 0 or until <= after:
        return []
    end = until.astimezone(zone).replace(tzinfo=None) + timedelta(hours=1)
    walker = croniter(expression, end + _ONE_US)
    found: set[datetime] = set()
    stop: datetime | None = None
    try:
        for _ in range(100_000):
            naive: datetime = walker.get_prev(datetime)
            if stop is not None and naive < stop:
                break
            at = _instant(naive, zone)
            if at <= after and not _near_transition(naive, zone):
                break
            if after < at <= until:
                found.add(at)
            if len(found) >= limit and stop is None:
                stop = naive - _TRANSITION_WINDOW
    except CroniterBadDateError:
        pass
    return sorted(found)[-limit:]


def first_fire(
    expression: str, zone: ZoneInfo, after: datetime, starts_at: datetime | None
) -> datetime | None:
    """The first fire of a schedule created (or resumed) at ``after``."""
    if starts_at is not None and starts_at > after:
        after = starts_at - _ONE_US
    return next_after(expression, zone, after)


def next_fire(
    expression: str,
    zone: ZoneInfo,
    after: datetime,
    starts_at: datetime | None,
    ends_at: datetime | None,
) -> datetime | None:
    """The first fire after ``after`` within the schedule's window, or None."""
    at = first_fire(expression, zone, after, starts_at)
    if at is None or (ends_at is not None and at > ends_at):
        return None
    return at


def _times_of_day(expression: str) -> list[int] | None:
    """The minutes of the day a five-field expression fires at, from its minute and hour
    fields; None when they are not plain lists."""
    fields: list[list[object]] = [list(f) for f in croniter(expression).expanded]
    minutes = list(range(60)) if fields[0] == ["*"] else fields[0]
    hours = list(range(24)) if fields[1] == ["*"] else fields[1]
    plain = [v for v in [*minutes, *hours] if isinstance(v, int)]
    if len(plain) != len(minutes) + len(hours):
        return None
    return sorted(
        {h * 60 + m for h in hours for m in minutes if isinstance(h, int) and isinstance(m, int)}
    )


def shortest_gap_s(expression: str, within_s: int) -> int | None:
    """The shortest wall-clock interval between two fires of ``expression`` if it is at
    most ``within_s`` (at most a day), else None. Read from the fields: fires within a
    day come from the minute and hour fields; the gap from a day's last fire to the next
    day's first counts only when two consecutive days both fire (looked up over the next
    four years). DST shifts are not counted (a fall-back hour may bring two fires closer
    by it)."""
    if expression.startswith("@"):
        expression = _MACRO_FIELDS[expression]
    times = _times_of_day(expression)
    if times is None:
        return None
    inner = min((b - a for a, b in itertools.pairwise(times)), default=None)
    if inner is not None and inner * 60 <= within_s:
        return inner * 60
    wrap = times[0] + 1440 - times[-1]
    if wrap * 60 > within_s or not _consecutive_days(expression, times[-1]):
        return None
    return wrap * 60


_MACRO_FIELDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def _consecutive_days(expression: str, last: int) -> bool:
    """Whether the expression fires on two consecutive days (at ``last``, its last
    minute of the day), within four years."""
    days = " ".join(expression.split(" ")[2:])
    daily = croniter(f"{last % 60} {last // 60} {days}", datetime(2000, 1, 1))
    previous = daily.get_next(datetime)
    for _ in range(4 * 366):
        at = daily.get_next(datetime)
        if at - previous == timedelta(days=1):
            return True
        if at.year > 2004:
            return False
        previous = at
    return False
