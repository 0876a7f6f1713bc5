"""The line of waiting claims (services/core/db/feed.py): an announcement wakes at most
as many waiting claims as its work can use, of the queues it names, longest waiting
first; a wake-up a claim could not use goes on to the next; the count survives the
NOTIFY payload between replicas."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from services.core.db.feed import Line, Work
from services.core.domain.placement import Amount


def _line(*queues: tuple[str, ...]) -> tuple[Line, list]:
    line = Line()
    return line, [line.join(i, q) for i, q in enumerate(queues)]


def test_work_for_one_task_wakes_one_claim_the_longest_waiting_of_its_queue() -> None:
    line, (a, b, c, d) = _line(("gpu",), ("default",), ("default", "gpu"), ("default",))
    assert line.wake(Work(queues={"default": 1})) == 1
    assert [w.woken for w in (a, b, c, d)] == [False, True, False, False]
    # The next task of the queue wakes the next in line, not the one already woken.
    assert line.wake(Work(queues={"default": 2})) == 2
    assert [w.woken for w in (a, b, c, d)] == [False, True, True, True]
    # Nothing of the queue is left waiting: more work wakes no one else.
    assert line.wake(Work(queues={"default": 5})) == 0
    assert not a.woken


def test_a_claim_about_to_look_keeps_its_place_and_one_that_found_nothing_goes_back() -> None:
    line, (a, b) = _line(("q",), ("q",))
    line.wake(Work(queues={"q": 1}))
    line.rest(a)  # about to look: later work wakes it anew, first in line still
    line.wake(Work(queues={"q": 1}))
    assert a.woken and not b.woken
    line.rest(a)
    line.back(a)  # it looked and found nothing it could take: the others come first
    line.wake(Work(queues={"q": 1}))
    assert b.woken and not a.woken
    line.wake(Work(sweep=True))  # the sweep reaches it again after them
    assert a.woken


def test_a_task_that_requires_labels_wakes_a_claim_whose_worker_has_them() -> None:
    line, (hdd, unread, ssd) = _line(("q",), ("q",), ("q",))
    hdd.facts = frozenset({"disk", "disk=hdd"})
    ssd.facts = frozenset({"disk", "disk=ssd", "zone", "zone=a"})
    rule = {"all": ["disk=ssd"], "none": [], "any": [["zone=a", "zone=b"]]}
    # The longest waiting claims cannot take it (hdd) or may (a worker not read yet).
    assert line.wake(Work(placed=(("q", rule),))) == 1
    assert [w.woken for w in (hdd, unread, ssd)] == [False, True, False]
    assert line.wake(Work(placed=(("q", rule), ("q", rule)))) == 1  # only ssd is left
    assert ssd.woken and not hdd.woken
    # Through the NOTIFY payload between replicas.
    both = Work(queues={"q": 1}) + Work(placed=(("q", rule),))
    assert Work.load(both.dump()) == both


def test_a_claim_whose_worker_is_not_read_yet_serves_every_queue() -> None:
    line = Line()
    w = line.join(7)  # joined before its turn's first look
    assert line.wake(Work(queues={"anything": 1})) == 1 and w.woken


def test_an_unused_wake_up_goes_to_the_next_claim_of_its_queues() -> None:
    line, (a, b, c) = _line(("x",), ("y",), ("x",))
    line.wake(Work(queues={"x": 1}))
    assert a.woken
    line.leave(a, used=False)  # its turn leased without waiting: the wake-up was not used
    assert c.woken and not b.woken
    line.leave(c)  # used: nothing more
    assert not b.woken and len(line) == 1


def test_workers_named_are_woken_whatever_the_counts() -> None:
    line, (a, b) = _line(("q",), ("q",))
    assert line.wake(Work(workers=frozenset([1]))) == 1
    assert b.woken and not a.woken


def test_room_freed_by_a_workers_reports_adds_up_on_its_claims_and_crosses_replicas() -> None:
    line, (a, b) = _line(("q",), ("q",))
    first = Work(freed={1: Amount(1.0, 400.0)})
    # Two reports' announcements coalesced into one payload: their room adds up.
    both = Work.load((first + Work(freed={1: Amount(0.5, 100.0)})).dump())
    assert both == Work(freed={1: Amount(1.5, 500.0)})
    assert line.wake(both) == 1
    assert b.woken and b.freed == Amount(1.5, 500.0)
    assert not a.woken and a.freed == Amount(0.0, 0.0)
    line.rest(b)  # looking: room freed meanwhile still counts, and wakes it again
    line.wake(first)
    assert b.woken and b.freed == Amount(2.5, 900.0)


def test_room_freed_wakes_a_claim_only_if_its_last_look_may_have_been_short_of_room() -> None:
    line, (a, b) = _line(("q",), ("q",))
    ended = Work(ended=frozenset([0]), freed={0: Amount(1.0, 100.0)})
    assert Work.load(ended.dump()) == ended
    # Not looked yet (or looking): it may be short, so room freed wakes it.
    assert line.wake(Work(ended=frozenset([0]))) == 1 and a.woken
    line.rest(a)
    line.looked(a, short=False)  # found nothing waiting at all
    line.looked(b, short=False)
    # Its room still grows, but it does not look again for it: nothing waits.
    assert line.wake(ended) == 0 and not a.woken and a.freed == Amount(1.0, 100.0)
    # Another claim here found work it did not take: room freed on a's worker may help.
    line.looked(b, short=True)
    assert line.wake(ended) == 1 and a.woken and a.freed == Amount(2.0, 200.0)
    line.rest(a)
    line.looked(a, short=True)  # work waited that it did not take
    assert line.wake(Work(ended=frozenset([0]))) == 1 and a.woken


def test_a_sweep_wakes_the_longest_waiting_claim_of_each_queue() -> None:
    line, ws = _line(("a",), ("a",), ("b",), ("a", "b"), ("c", "a"))
    assert line.wake(Work(sweep=True)) == 3
    assert [w.woken for w in ws] == [True, False, True, False, True]


def test_any_wakes_the_longest_waiting_whatever_their_queues() -> None:
    line, ws = _line(("a",), ("b",), ("c",))
    assert line.wake(Work(any=2)) == 2
    assert [w.woken for w in ws] == [True, True, False]


def test_a_woken_waiter_returns_at_once_and_an_idle_one_after_its_timeout() -> None:
    async def run() -> None:
        line = Line()
        w = line.join(1, ["q"])
        assert not await w.wait(0.01)
        line.wake(Work(queues={"q": 1}))
        assert await w.wait(5.0)

    asyncio.run(run())


def test_a_waiting_claim_wakes_as_work_is_announced_and_rests_until_the_next() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        line = Line()
        w = line.join(1, ["q"])
        waiting = asyncio.ensure_future(w.wait(5.0))
        await asyncio.sleep(0)
        began = loop.time()
        line.wake(Work(queues={"q": 1}))
        assert await waiting and loop.time() - began < 1.0
        line.rest(w)  # about to look again: the wake-up it had is used
        assert not await w.wait(0.01)

    asyncio.run(run())


def test_counts_add_up_across_announcements_coalesced_into_one_payload() -> None:
    total = (
        Work(queues={"a": 1}) + Work(queues={"a": 2, "b": 1}, any=1) + Work(workers=frozenset([3]))
    )
    assert Work.load(total.dump()) == Work(queues={"a": 3, "b": 1}, any=1, workers=frozenset([3]))
    assert not Work() and Work(sweep=True)


def test_a_payload_naming_too_much_or_unreadable_becomes_a_sweep_with_the_count() -> None:
    many = Work(queues={f"q{i}": 1 for i in range(500)})
    back = Work.load(many.dump())
    assert back.sweep and back.any == 500 and not back.queues
    assert len(many.dump()) < 7900
    # Room freed on workers stays (a sweep cannot stand in for it), within the bound.
    room = Amount(1 / 3, 1e6 / 7)
    crowd = many + Work(freed={10**9 + i: room for i in range(300)})
    back = Work.load(crowd.dump())
    assert back.sweep and back.any == 500 and len(back.freed) == 200
    assert back.freed[10**9] == Amount(0.333, 142857.142)
    assert len(crowd.dump()) < 7900
    assert Work.load("not json") == Work(sweep=True)
    assert Work.load('{"q": 3}') == Work(sweep=True)


@given(
    queues=st.lists(st.sets(st.sampled_from("abc"), min_size=1), min_size=0, max_size=30),
    offered=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 40)),
)
def test_never_more_woken_than_offered_and_never_one_that_cannot_use_it(
    queues: list[set[str]], offered: dict[str, int]
) -> None:
    line, ws = _line(*(tuple(q) for q in queues))
    woken = line.wake(Work(queues=offered))
    assert woken == sum(w.woken for w in ws) <= sum(offered.values())
    for w in ws:
        if w.woken:
            assert w.queues & {q for q, n in offered.items() if n}
    # Longest waiting first: per queue, no woken waiter stands behind an idle one that
    # the same work could have woken instead, unless that queue's count was used up.
    for q, n in offered.items():
        serving = [w for w in ws if q in w.queues]
        woken_for_q = [w.woken for w in serving]
        if n >= len(serving):
            assert all(woken_for_q)
