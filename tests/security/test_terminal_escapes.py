"""A task's log and a task's name are written by whoever submitted it, and read in someone
else's terminal: a real worker runs a task whose log writes the clipboard (OSC 52), clears
the screen and forges the window's title, and the real CLI, against a real core, shows
every such sequence escaped unless told ``--raw``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A core that ships logs every 0.5 s, and a real worker agent for it.
from tests.faults.worker.test_live_logs import core, worker
from tests.support import Core, shell_spec, wait_for

pytestmark = pytest.mark.slow
__all__ = ["core", "worker"]  # the fixtures, used by name below

# Clipboard write, screen clear and a forged title (ESC ... BEL), then an 8-bit CSI (U+009B).
HOSTILE = r"printf 'before\033]52;c;aGFja2Vk\007\033[2J\033]0;forged\007\302\2332Jafter\n'"
# Rich markup would make a hyperlink of it; U+009B is a C1 control (CSI) a name may hold.
NAME = "[link=https://evil.example]click[/link] \u009b2J"


def _cairn(core: Core, home: Path, *args: str) -> bytes:
    env = {
        **os.environ,
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": core.tokens["alice"],
        "CAIRN_HOME": str(home),
        "CAIRN_CONFIG": str(home / "no-config.toml"),
    }
    for forcing in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        env.pop(forcing, None)
    done = subprocess.run(
        [sys.executable, "-m", "cairn", *args], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout + done.stderr


def _harmless(shown: bytes) -> str:
    text = shown.decode()
    assert b"\x1b" not in shown and b"\x07" not in shown
    assert "\u009b" not in text
    return text


def test_the_cli_escapes_a_tasks_terminal_sequences_unless_raw(
    core: Core, worker: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    with core.client("alice") as alice:
        made = alice.post("/v1/tasks", json=shell_spec(HOSTILE, name=NAME))
        assert made.status_code == 201, made.text
        task_id = str(made.json()["id"])
        wait_for(lambda: alice.get(f"/v1/tasks/{task_id}").json()["state"] == "succeeded", 60)
        stored = alice.get(f"/v1/tasks/{task_id}/logs").text
    assert "\x1b]52;c;aGFja2Vk\x07" in stored  # the attack reached core as written

    for args in (["logs", task_id], ["logs", "-f", task_id]):
        text = _harmless(_cairn(core, tmp_path, *args))
        assert "before\\x1b]52;c;aGFja2Vk\\x07\\x1b[2J\\x1b]0;forged\\x07\\x9b2Jafter\n" in text

    raw = _cairn(core, tmp_path, "logs", "--raw", task_id)
    assert b"\x1b]52;c;aGFja2Vk\x07\x1b[2J\x1b]0;forged\x07\xc2\x9b2Jafter\n" in raw

    # The name, in a table and in a line: shown as written, neither a link nor a control.
    for args in (["get", task_id], ["ls"], ["why", task_id]):
        text = _harmless(_cairn(core, tmp_path, *args))
        assert "[link=https://evil.example]click[/link] \\x9b2J" in text
