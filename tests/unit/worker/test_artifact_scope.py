"""The worker fetches ``s3://`` artifacts as the task's owner, not as itself
(docs/security.md, "Artifact credentials"): against a moto server that enforces IAM, two
buckets readable by different keys. The worker's own keys read the ``internal`` bucket
only; the payroll team's keys read ``payroll-tools`` only."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from libs.common.models import S3Credentials
from services.worker.artifacts import ArtifactCache, ArtifactError, Sealed
from tests.fixtures.s3 import (
    INTERNAL,
    INTERNAL_SHA,
    TOOL,
    TOOL_SHA,
    IamS3,
    iam_s3_server,
    worker_env,
)

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def iam_s3() -> Iterator[IamS3]:
    with iam_s3_server() as server:
        yield server


@pytest.fixture
def keys(iam_s3: IamS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, S3Credentials]:
    for name, value in worker_env(iam_s3).items():
        monkeypatch.setenv(name, value)
    return iam_s3.keys


def test_a_task_fetches_from_its_teams_bucket_with_its_teams_keys(
    tmp_path: Path, keys: dict[str, S3Credentials]
) -> None:
    cache = ArtifactCache(tmp_path / "cache")

    path = _run(cache.fetch("s3://payroll-tools/tool.sh", TOOL_SHA, credentials=keys["payroll"]))

    assert path.read_bytes() == TOOL
    # The same keys cannot read what only the worker's role may.
    with pytest.raises(ArtifactError, match="AccessDenied") as caught:
        _run(cache.fetch("s3://internal/tool.sh", INTERNAL_SHA, credentials=keys["payroll"]))
    assert caught.value.retryable is False


def test_a_bucket_outside_the_setting_is_refused_without_credentials(
    tmp_path: Path, keys: dict[str, S3Credentials]
) -> None:
    cache = ArtifactCache(tmp_path / "cache", s3_own_buckets=frozenset({"tools"}))

    with pytest.raises(ArtifactError) as caught:
        _run(cache.materialize("s3://internal/tool.sh", INTERNAL_SHA, tmp_path))

    assert caught.value.retryable is False
    assert "'internal'" in caught.value.reason
    assert "CAIRN_WORKER_S3_OWN_BUCKETS" in caught.value.reason
    assert "artifact.credentials" in caught.value.reason
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # nothing fetched


def test_the_workers_own_keys_serve_the_buckets_the_operator_lists(
    tmp_path: Path, keys: dict[str, S3Credentials]
) -> None:
    cache = ArtifactCache(tmp_path / "cache", s3_own_buckets=frozenset({"internal"}))

    copy = _run(cache.materialize("s3://internal/tool.sh", INTERNAL_SHA, tmp_path))

    assert copy.read_bytes() == INTERNAL


def test_a_digest_cached_by_another_fetch_is_not_handed_to_other_credentials(
    tmp_path: Path, keys: dict[str, S3Credentials]
) -> None:
    cache = ArtifactCache(tmp_path / "cache", s3_own_buckets=frozenset({"internal"}))
    sealed = Sealed(tmp_path / "sealed", 1 << 20)
    sealed.folder.mkdir()
    # The worker's own fetch of the internal tool, cached and sealed.
    _run(cache.seal("s3://internal/tool.sh", INTERNAL_SHA, sealed))
    _run(cache.materialize("s3://internal/tool.sh", INTERNAL_SHA, tmp_path))
    payroll = keys["payroll"]
    stranger = S3Credentials(access_key_id=payroll.access_key_id, secret_access_key="guessed")

    # Naming its digest with other keys fetches with those keys: refused, not a cache hit.
    for credentials in (payroll, stranger):
        for made in (
            cache.materialize("s3://internal/tool.sh", INTERNAL_SHA, tmp_path, None, credentials),
            cache.seal("s3://internal/tool.sh", INTERNAL_SHA, sealed, credentials),
            cache.fetch("s3://payroll-tools/tool.sh", INTERNAL_SHA, credentials=credentials),
        ):
            with pytest.raises(ArtifactError, match=r"AccessDenied|mismatch|Signature"):
                _run(made)


def test_an_endpoint_in_credentials_is_a_source_the_worker_must_allow(
    tmp_path: Path, iam_s3: IamS3, keys: dict[str, S3Credentials]
) -> None:
    named = keys["payroll"].model_copy(update={"endpoint": iam_s3.endpoint})
    uri = "s3://payroll-tools/tool.sh"
    closed = ArtifactCache(tmp_path / "a", allow_insecure_http=True, sources=("s3://",))
    wide = ArtifactCache(tmp_path / "b", sources=("s3://", f"{iam_s3.endpoint}/"))
    opened = ArtifactCache(
        tmp_path / "c", allow_insecure_http=True, sources=("s3://", f"{iam_s3.endpoint}/")
    )

    for cache, refused in ((closed, "not an allowed artifact source"), (wide, "https only")):
        with pytest.raises(ArtifactError, match=refused) as caught:
            _run(cache.fetch(uri, TOOL_SHA, credentials=named))
        assert caught.value.retryable is False
    assert _run(opened.fetch(uri, TOOL_SHA, credentials=named)).read_bytes() == TOOL


def test_a_cache_of_before_scoped_names_is_emptied_once(tmp_path: Path) -> None:
    """An s3 artifact it named by digest alone would answer an https URI of that digest."""
    root = tmp_path / "cache"
    old = root / INTERNAL_SHA[:2] / INTERNAL_SHA
    old.parent.mkdir(parents=True)
    old.write_bytes(INTERNAL)

    ArtifactCache(root)
    assert not old.exists()
    old.write_bytes(INTERNAL)  # as if fetched under the new names: kept from now on
    ArtifactCache(root)
    assert old.exists()
