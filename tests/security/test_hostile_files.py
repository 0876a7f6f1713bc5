"""Files a hostile task leaves for its agent to read back (its outputs, its progress and
checkpoint), against a real root agent and a real core: whatever they hold, the agent
reports on the task's behalf and goes on serving, and the database says why."""

from __future__ import annotations

from tests.security.test_hostile_tasks import (  # noqa: F401 - fixtures
    Agent,
    agents,
    core,
    run,
    shell,
)

#: a lone surrogate, as a JSON escape (the file itself is plain ASCII, valid UTF-8)
SURROGATE = "\\\\ud800"


def test_outputs_no_report_can_carry_fail_the_attempt_and_the_agent_goes_on(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
    db,
):
    """A lone surrogate (a JSON ``\\ud800`` escape) made the turn that carried the
    report fail to encode: the report never left, the attempt stayed running for core
    and held its slot. An integer past 64 bits failed core's encoder: every turn of
    the worker (its other reports, its claims) was a 500 for the report's 5 minutes of
    patience. Arrays nested past the parser's recursion limit raised inside the agent
    ("the agent failed", retried). Each is refused now, naming the rule, and the agent
    goes on."""
    agent = Agent(core, tmp_path / "w")
    agents.append(agent)
    deep = 32  # the outputs object is level 1: one level too many
    tasks = {
        "surrogate": f'printf \'{{"a": "{SURROGATE}"}}\' > "$CAIRN_OUTPUTS"',
        "deep": f'printf \'{{"a": {"[" * deep}{"]" * deep}}}\' > "$CAIRN_OUTPUTS"',
        "huge": f'printf \'{{"n": {2**64}}}\' > "$CAIRN_OUTPUTS"',
        "deeper": f'printf \'{{"a": {"[" * 3000}{"]" * 3000}}}\' > "$CAIRN_OUTPUTS"',
    }
    ended = {name: run(core, shell(script)) for name, script in tasks.items()}
    fine = run(core, shell('echo \'{"rows": 7}\' > "$CAIRN_OUTPUTS"'))

    assert agent.proc.poll() is None, "the agent exited"
    for name, task in ended.items():
        [attempt] = task["attempts_list"]
        assert task["state"] == "dead" and attempt["outcome"] == "failed", (name, task)
        assert attempt["error"].startswith("CAIRN_OUTPUTS: "), (name, attempt["error"])
        row = db.execute(
            "SELECT outcome, outputs FROM core.attempts WHERE id = %s", (attempt["id"],)
        ).fetchone()
        assert row == ("failed", None), (name, row)
    assert "unpaired surrogate" in ended["surrogate"]["attempts_list"][0]["error"]
    assert "nested deeper" in ended["deep"]["attempts_list"][0]["error"]
    assert "nested deeper" in ended["deeper"]["attempts_list"][0]["error"]
    assert "64 bits" in ended["huge"]["attempts_list"][0]["error"]
    [done] = fine["attempts_list"]
    assert done["outcome"] == "succeeded" and done["outputs"] == {"rows": 7}, fine


def test_a_progress_file_the_agent_cannot_take_keeps_the_checkpoint_written_beside_it(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
    db,
):
    """docs/progress.md: a progress file the agent cannot take is skipped with a line in
    the attempt's log, and what else the attempt wrote stays. A message holding a lone
    surrogate (refused by the note's model) or arrays nested past the parser's recursion
    limit (4 KiB is enough) raised out of the agent's look instead: the checkpoint
    written beside it was dropped with the note, and the log said nothing."""
    agents.append(Agent(core, tmp_path / "w"))
    bad = {
        "surrogate": f'{{"fraction": 0.5, "message": "a{SURROGATE}b"}}',
        "deep": f'{{"message": {"[" * 2000}{"]" * 2000}}}',
    }
    resuming = (
        'if [ -n "$CAIRN_CHECKPOINT" ]; then echo "resumed from $(cat "$CAIRN_CHECKPOINT")"; '
        "exit 0; fi; "
        "printf 'step=7' > \"$CAIRN_CHECKPOINT_OUT\"; "
        "printf '%s' > \"$CAIRN_PROGRESS\"; exit 3"
    )
    retry = {"max_attempts": 2, "base_s": 0.1, "jitter": False}
    ended = {name: run(core, shell(resuming % text, retry=retry)) for name, text in bad.items()}
    said = {}
    for name, task in ended.items():
        first, second = sorted(task["attempts_list"], key=lambda a: a["number"])
        assert (first["outcome"], second["outcome"]) == ("failed", "succeeded"), (name, task)
        assert "resumed from step=7" in task["log"], (name, task["log"])
        with core.client() as alice:
            path = f"/v1/tasks/{task['id']}/logs?attempt_id={first['id']}"
            said[name] = alice.get(path).text
        assert "cairn: CAIRN_PROGRESS: " in said[name], (name, said[name])
        assert "ignored, the last good one is kept" in said[name], (name, said[name])
    assert "unpaired surrogate" in said["surrogate"], said
    assert "nested deeper than" in said["deep"], said
