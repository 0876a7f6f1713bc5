"""docs/sdk.md tells the truth: its worked example (docs/examples/daily_files.py) renders
to the JSON definition the page shows, which the DAG service's graph check accepts."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from cairn.sdk import load_file
from libs.common.dag_models import WorkflowCreate
from services.dag.domain import graph

DOCS = Path(__file__).resolve().parents[3] / "docs"


def test_the_worked_example_renders_the_definition_the_page_shows() -> None:
    [daily] = load_file(DOCS / "examples" / "daily_files.py")
    page = (DOCS / "sdk.md").read_text()
    shown = re.search(r"```json\n(.*?)```", page, re.S)
    assert shown is not None
    digest = hashlib.sha256(Path("/bin/sh").read_bytes()).hexdigest()
    by_hand = json.loads(shown[1].replace('"sha256": "…"', f'"sha256": "{digest}"'))
    assert daily.render() == WorkflowCreate.model_validate(by_hand)
    assert graph.build(daily.render()).order == ("extract", "load", "report", "alert")


def test_the_example_in_the_page_is_the_example_file() -> None:
    page = (DOCS / "sdk.md").read_text()
    shown = re.search(r"```python\n(.*?)```", page, re.S)
    assert shown is not None
    code = (DOCS / "examples" / "daily_files.py").read_text()
    body = code[code.index("SH = Artifact") :]
    assert body.strip() in shown[1]


def test_the_approval_and_sub_workflow_example_renders_what_the_page_shows() -> None:
    page = (DOCS / "sdk.md").read_text()
    section = page[page.index("## Approval gates and sub-workflows") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    shown = re.search(r"```\n(\[.*?)```", section, re.S)
    assert code is not None and shown is not None
    digest = hashlib.sha256(Path("/bin/sh").read_bytes()).hexdigest()
    made: dict = {}
    exec(code[1].replace('sha256="…"', f'sha256="{digest}"'), made)
    release = made["release"]
    assert release.to_dict()["nodes"][:2] == json.loads(shown[1])
    assert graph.build(release.render()).order == ("counted", "sign-off", "publish")
