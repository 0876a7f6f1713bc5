"""``bench/backlog_idle.py`` groups the server log's slow statements by their first words,
the text taken from the duration's line and the lines after it (a statement's text
starts on its own line after ``execute <name>:``), with their count, total and most."""

from __future__ import annotations

from pathlib import Path

from tests.support.bench import load

LOG = """\
2026-12-07 16:00:16.096 UTC [1330] LOG:  duration: 162.311 ms  execute _pg3_14:
\tWITH picked AS (
\t    SELECT id, deferred FROM core.tasks t
\t    WHERE t.state = 'waiting'
2026-12-07 16:00:16.096 UTC [1330] DETAIL:  Parameters: $1 = '1000'
2026-12-07 16:00:17.100 UTC [1330] LOG:  duration: 37.5 ms  execute _pg3_14:
\tWITH picked AS (
\t    SELECT id, deferred FROM core.tasks t
2026-12-07 16:00:17.200 UTC [1331] LOG:  duration: 6.0 ms  statement: SELECT 1
2026-12-07 16:00:17.300 UTC [1331] LOG:  checkpoint starting: time
"""


def test_slow_statements_are_grouped_by_their_first_words(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(LOG)
    found = load("backlog_idle").slow_statements(log)
    park = "WITH picked AS ( SELECT id, deferred FROM core.tasks"
    assert found[park] == (2, 162.311 + 37.5, 162.311)
    [other] = [k for k in found if k != park]
    assert other.startswith("SELECT 1") and found[other] == (1, 6.0, 6.0)
