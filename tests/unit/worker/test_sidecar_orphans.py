"""The sidecar kills what a gone (or hung) agent's attempts left (``sidecar._orphans_killed``)
and nothing else. A leader its spawn helper reaped stays on the board until the agent
hears of its exit, and by then its pid may lead another process's group: pids wrap at
``pid_max`` (32,768 here) and every PostgreSQL backend leads a group of its own. Killing
that group by its id alone, as root, had SIGKILLed whatever took the pid."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from services.worker import sidecar

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another uid")

STRANGER = 65534  # nobody: the stand-in for a PostgreSQL backend of another user
OWN = 31990  # an attempt's uid outside every pool the tests hand out (20000-30003)


def _leader(uid: int | None = None) -> subprocess.Popen[bytes]:
    """A process that leads a process group of its own (as a backend does), as ``uid``."""
    if uid is None:
        return subprocess.Popen(["sleep", "60"], start_new_session=True)
    return subprocess.Popen(
        ["sleep", "60"], start_new_session=True, user=uid, group=uid, extra_groups=[]
    )


@pytest.fixture
def leaders() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def _gone(proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 5
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.poll() is not None


def test_a_group_whose_id_another_users_process_took_is_spared(
    leaders: list[subprocess.Popen[bytes]],
) -> None:
    stranger, ours = _leader(STRANGER), _leader()
    leaders += [stranger, ours]
    # Attempt 1 ran as the agent's uid and its pid now leads another user's group;
    # attempt 2, of the agent's uid too, still runs.
    sidecar._orphans_killed({"attempts": {"1": stranger.pid, "2": ours.pid}})
    assert _gone(ours)
    time.sleep(0.1)
    assert stranger.poll() is None


def test_an_attempt_with_a_uid_of_its_own_is_reached_through_its_uid_not_its_group(
    leaders: list[subprocess.Popen[bytes]],
) -> None:
    stranger, own = _leader(STRANGER), _leader(OWN)
    leaders += [stranger, own]
    # Attempt 3 ran as uid OWN: its leader's pid was taken by another user's process,
    # and another of its processes still runs.
    sidecar._orphans_killed({"attempts": {"3": stranger.pid}, "uids": {"3": OWN}})
    assert _gone(own)
    time.sleep(0.1)
    assert stranger.poll() is None
