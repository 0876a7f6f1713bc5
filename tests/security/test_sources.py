"""The allow-list of artifact sources (CAIRN_ARTIFACT_SOURCES) at submit: a 422 naming the
field, for single and batch submissions, and no way around it with dot segments."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.common.sources import parse_sources, source_allowed
from tests.support import TRUE_SHA, Core, spec

pytestmark = pytest.mark.core(artifact_sources="s3://jobs/,file:///opt/jobs/")


def _artifact(uri: str) -> dict:
    return {"uri": uri, "sha256": TRUE_SHA}


def test_a_submission_from_outside_the_allow_list_is_refused_naming_the_field(core: Core) -> None:
    with core.client() as alice:
        refused = alice.post("/v1/tasks", json=spec(artifact=_artifact("file:///bin/true")))
        allowed = alice.post("/v1/tasks", json=spec(artifact=_artifact("s3://jobs/true")))
        batch = alice.post(
            "/v1/tasks/batch",
            json={"tasks": [spec(artifact=_artifact("s3://jobs/a")), spec()]},
        )
    assert refused.status_code == 422
    assert refused.json()["errors"][0]["field"] == "body.artifact.uri"
    assert allowed.status_code == 201
    assert batch.status_code == 422
    assert [e["field"] for e in batch.json()["errors"]] == ["body.tasks.1.artifact.uri"]


@pytest.mark.parametrize(
    "uri",
    [
        "file:///opt/jobs/../../etc/shadow",
        "file:///opt/jobs/%2e%2e/%2e%2e/etc/shadow",
        "s3://jobs.evil/x",
        "s3://jobsx/x",
        "https://jobs/x",
    ],
)
def test_lookalikes_and_dot_segments_are_outside_the_list(uri: str) -> None:
    assert not source_allowed(uri, parse_sources("s3://jobs/,file:///opt/jobs/"))


def test_a_prefix_must_end_with_a_slash() -> None:
    with pytest.raises(ValueError, match="ending with '/'"):
        parse_sources("https://artifacts.corp")


def test_no_list_is_open_and_production_requires_one(tmp_path: Path) -> None:
    from services.core.settings import CoreSettings
    from services.worker.settings import WorkerSettings

    assert source_allowed("file:///anything", ())
    url = "postgresql://u:p@h/db"
    with pytest.raises(ValueError, match="CAIRN_ARTIFACT_SOURCES is required"):
        CoreSettings(env="production", database_url=url, secrets_key="k" * 43 + "=")
    with pytest.raises(ValueError, match="CAIRN_ARTIFACT_SOURCES is required"):
        WorkerSettings(env="production")
    assert WorkerSettings(env="production", artifact_sources="s3://jobs/").sources == (
        "s3://jobs/",
    )
