"""What the end of an attempt does to its task: the table from a worker's reported outcome
to the move (op, target state, reason), the failure rule (retry after backoff, or bury),
and the restarts of services. Pure: the database layer reads the facts and applies the move
through the transitions table."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from libs.common.models import ALWAYS_RETRY_LIMIT, NO_RETRY_EXIT_CODE, HandBackCause
from libs.common.states import REPORTED_OUTCOMES, ReportedOutcome, TaskState
from services.core.domain.retry import SERVICE_RESTARTS, Backoff
from services.core.domain.transitions import Op

S = TaskState

#: hand-backs in a row because the task's ``file://`` source did not answer after which
#: the task is buried (``CAIRN_SOURCE_UNANSWERED_MAX``)
SOURCE_UNANSWERED_MAX = 20


class Budget(Protocol):
    """What of a task the decision reads (a task row has these columns)."""

    @property
    def kind(self) -> str: ...
    @property
    def attempts(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def recent_crashes(self) -> int:
        """Crashes within its ``poison_window_s`` (the database counts them)."""

    @property
    def poison_after(self) -> int: ...
    @property
    def poison_window_s(self) -> float: ...
    @property
    def retry_causes(self) -> Mapping[str, Any] | None:
        """``RetryPolicy.never`` and ``always`` as stored: ``{"never": {"exit_codes":
        [...], "signals": [...]}, "always": {...}}``, or None."""

    @property
    def backoff_base_s(self) -> float: ...
    @property
    def backoff_cap_s(self) -> float: ...
    @property
    def backoff_jitter(self) -> bool: ...
    @property
    def artifact_uri(self) -> str: ...
    @property
    def source_handbacks(self) -> int:
        """Its attempts handed back in a row because its source did not answer."""


@dataclass(frozen=True)
class Move:
    """One task's move at the end of its attempt. ``refund`` gives the attempt back;
    ``crashed`` counts towards the poison-pill limit; ``delay_s`` is a retry's backoff;
    ``unanswered``: a hand-back because its source did not answer, counted towards
    ``SOURCE_UNANSWERED_MAX`` (any other end of an attempt than a hand-back resets the
    count)."""

    op: Op
    target: TaskState
    reason: str
    error: str | None = None
    refund: bool = False
    crashed: bool = False
    delay_s: float | None = None
    unanswered: bool = False


@dataclass(frozen=True)
class Rule:
    """A reported outcome's move, or ``failure`` (retried or buried by ``failed``)."""

    op: Op | None
    target: TaskState | None
    reason: str
    refund: bool = False
    crashed: bool = False

    @property
    def failure(self) -> bool:
        return self.op is None


_FAILURE = Rule(None, None, "")

#: every outcome a worker may report, and what it does to a task (kind ``task``)
OUTCOMES: dict[ReportedOutcome, Rule] = {
    "succeeded": Rule(Op.SUCCEED, S.SUCCEEDED, "exited 0"),
    "handed_back": Rule(Op.REQUEUE, S.WAITING, "handed back by its worker", refund=True),
    "preempted": Rule(Op.PREEMPT, S.WAITING, "preempted by its worker, requeued", refund=True),
    "failed": _FAILURE,
    "timeout": _FAILURE,
    "oom_killed": _FAILURE,
    "disk_exceeded": _FAILURE,
    "crashed": Rule(None, None, "", crashed=True),
}

assert set(OUTCOMES) == set(REPORTED_OUTCOMES), "a reported outcome without a rule"

#: outcomes that give the attempt back whatever the kind (a service too)
GIVEN_BACK = frozenset(name for name, rule in OUTCOMES.items() if rule.refund)


def backoff_s(task: Budget, failures: int) -> float:
    curve = Backoff(task.backoff_base_s, task.backoff_cap_s, task.backoff_jitter)
    return curve.delay_s(failures)


@dataclass(frozen=True)
class Cause:
    """Why an attempt failed, as its worker reported it: the code it exited with, or the
    signal that killed it; ``number``: the attempt's number (1 for the first)."""

    exit_code: int | None = None
    signal: int | None = None
    number: int = 1


def _listed(task: Budget, which: str, cause: Cause) -> str | None:
    """The cause, named, if the task's retry policy lists it under ``which``."""
    listed = (task.retry_causes or {}).get(which) or {}
    if cause.exit_code is not None and cause.exit_code in listed.get("exit_codes", ()):
        return f"exit code {cause.exit_code}"
    if cause.signal is not None and cause.signal in listed.get("signals", ()):
        return f"signal {cause.signal}"
    return None


def by_cause(task: Budget, cause: Cause | None, error: str) -> Move | None:
    """The move the failure's cause decides, if it decides one: a cause the policy
    never retries (or exit code ``NO_RETRY_EXIT_CODE``, unless listed as always) buries
    the task; one it always retries is retried after backoff without spending an
    attempt (nor counting as a crash), up to ``ALWAYS_RETRY_LIMIT`` attempts in all."""
    if cause is None:
        return None
    never = _listed(task, "never", cause)
    if never is not None:
        return Move(Op.BURY, S.DEAD, f"not retryable: {never} is never retried", error)
    always = _listed(task, "always", cause)
    if always is None and cause.exit_code == NO_RETRY_EXIT_CODE:
        reason = f"not retryable: exited {NO_RETRY_EXIT_CODE}, the code that asks for no retry"
        return Move(Op.BURY, S.DEAD, reason, error)
    if always is None or cause.number >= ALWAYS_RETRY_LIMIT:
        return None
    delay = backoff_s(task, min(cause.number, 20))
    reason = f"{always} is always retried: after backoff, no attempt spent"
    return Move(Op.FAIL, S.FAILED, reason, error, refund=True, delay_s=delay)


def span(seconds: float) -> str:
    """A window as people read it: ``72 h``, ``30 min``, ``45 s``."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def failed(
    task: Budget, error: str, *, retryable: bool, crashed: bool, cause: Cause | None = None
) -> Move:
    """A failed or lost attempt of a task: retry after backoff, or bury (not retryable,
    by its cause, poison pill: crashes within the window, attempts spent)."""
    if not retryable:
        return Move(Op.BURY, S.DEAD, "not retryable", error, crashed=crashed)
    decided = by_cause(task, cause, error)
    if decided is not None:
        return decided
    crashes = task.recent_crashes + (1 if crashed else 0)
    if crashes >= task.poison_after:
        window = span(task.poison_window_s)
        reason = f"poison pill: lost {crashes} times within {window}"
        return Move(Op.BURY, S.DEAD, reason, error, crashed=crashed)
    if task.attempts >= task.max_attempts:
        return Move(Op.BURY, S.DEAD, f"attempts spent ({task.attempts})", error, crashed=crashed)
    delay = backoff_s(task, min(task.attempts, 20))
    return Move(Op.FAIL, S.FAILED, "retry after backoff", error, crashed=crashed, delay_s=delay)


def preempted_reason(by: int | None, why: str | None) -> str:
    """The event's reason: the guaranteed task it made room for, or the worker's reason."""
    if by:
        return f"preempted by task {by}, requeued"
    if why:
        return f"preempted by its worker: {why}; requeued"
    return OUTCOMES["preempted"].reason


def reported(
    task: Budget,
    outcome: ReportedOutcome,
    error: str | None,
    *,
    retryable: bool,
    preempted_by: int | None = None,
    cause: Cause | None = None,
    hand_back_cause: HandBackCause | None = None,
    source_cap: int = SOURCE_UNANSWERED_MAX,
) -> Move | None:
    """The move a worker's report makes (``cause``: its exit code or signal, which the
    task's retry policy may name; ``hand_back_cause``: why it was handed back, counted
    towards ``source_cap`` for ``source``); None for a service's exit, which its restart
    history decides (``restarted``)."""
    rule = OUTCOMES[outcome]
    if outcome == "preempted":
        reason = preempted_reason(preempted_by, error)
        return Move(Op.PREEMPT, S.WAITING, reason, refund=True)
    if outcome == "handed_back" and hand_back_cause == "source" and _local(task.artifact_uri):
        return source_unanswered(task, error, source_cap)
    if task.kind == "service" and outcome not in GIVEN_BACK and (retryable or not rule.failure):
        return None
    if rule.failure:
        message = error or f"attempt {outcome}"
        return failed(task, message, retryable=retryable, crashed=rule.crashed, cause=cause)
    assert rule.op is not None and rule.target is not None
    reason = (error or rule.reason) if outcome == "handed_back" else rule.reason
    return Move(rule.op, rule.target, reason, refund=rule.refund)


def _local(uri: str) -> bool:
    """Whether ``uri`` names a ``file://`` source, the only kind a worker checks: the
    cause ``source`` on any other task is an ordinary hand-back (so the burial's reason
    never names a URI that may carry credentials in its query, a presigned URL's)."""
    return urllib.parse.urlsplit(uri).scheme == "file"


def source_unanswered(task: Budget, error: str | None, cap: int) -> Move:
    """A start handed back because the task's ``file://`` source did not answer (the
    host's fault: no attempt spent), once more in a row: back to waiting, or buried once
    that makes ``cap`` (a source that hangs on every worker would otherwise be handed
    back for good, about once per source limit and worker)."""
    count = task.source_handbacks + 1
    if count >= cap:
        reason = (
            f"its source {task.artifact_uri} did not answer on {count} starts in a row "
            "(CAIRN_SOURCE_UNANSWERED_MAX): retry it once its file system answers"
        )
        return Move(Op.BURY, S.DEAD, reason, error, refund=True, unanswered=True)
    reason = error or OUTCOMES["handed_back"].reason
    return Move(Op.REQUEUE, S.WAITING, reason, refund=True, unanswered=True)


def service_error(outcome: str, error: str | None) -> str:
    if outcome == "succeeded":
        return "service exited 0"
    return error or f"attempt {outcome}"


def restarted(
    task: Budget, error: str, *, crashes: int, streak: int, crashed: bool, host_died: bool
) -> Move:
    """Services run until cancelled: every exit is restarted with crash-loop backoff
    (``streak``: restarts since its last healthy run); ``crashes`` within the window bury
    it; one whose host died is placed again at once and that counts for nothing."""
    policy = SERVICE_RESTARTS
    crashed = crashed and not host_died
    if crashes >= task.poison_after:
        window = span(policy.window_s)
        reason = f"poison pill: crashed {crashes} times within {window}"
        return Move(Op.BURY, S.DEAD, reason, error, crashed=crashed)
    if host_died:
        return Move(Op.FAIL, S.FAILED, "its host died; placed again", error, delay_s=0.0)
    delay = backoff_s(task, max(1, min(streak, 20)))
    reason = "service exited; restarting after backoff"
    return Move(Op.FAIL, S.FAILED, reason, error, crashed=crashed, delay_s=delay)


def lost_unstarted(why: str, cause: str) -> Move:
    """A lease no heartbeat showed running (or lost while core could not hear): back to
    waiting at no cost."""
    reason = f"{why}; {cause}, so it costs no attempt"
    return Move(Op.REQUEUE, S.WAITING, reason, refund=True)
