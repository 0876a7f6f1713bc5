"""The worker fetches ``s3://`` artifacts as the task's owner, not as itself
(docs/security.md, "Artifact credentials"): against a moto server that enforces IAM, two
buckets readable by different keys. The worker's own keys read the ``internal`` bucket
only; the payroll team's keys read ``payroll-tools`` only."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from libs.common.models import S3Credentials
from services.worker.artifacts import ArtifactCache, ArtifactError, Sealed

T = TypeVar("T")
TOOL = b"#!/bin/sh\necho payroll\n"
TOOL_SHA = hashlib.sha256(TOOL).hexdigest()
INTERNAL = b"#!/bin/sh\necho only the worker's role may read me\n"
INTERNAL_SHA = hashlib.sha256(INTERNAL).hexdigest()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _policy(bucket: str) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": "s3:GetObject",
                    "Resource": f"arn:aws:s3:::{bucket}/*",
                }
            ],
        }
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def iam_s3() -> Iterator[tuple[str, dict[str, S3Credentials]]]:
    """A moto server with the two buckets and a user's keys for each, IAM enforced."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
        pytest.skip("moto[server] and boto3 are not installed in this environment")
    port = _free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert moto.poll() is None, "the moto server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the moto server did not start"
                time.sleep(0.05)
        yield endpoint, _populate(endpoint)
    finally:
        moto.terminate()
        moto.wait(timeout=10)


def _populate(endpoint: str) -> dict[str, S3Credentials]:
    boto3 = importlib.import_module("boto3")
    admin = {
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": "admin",
        "aws_secret_access_key": "admin",
    }
    s3, iam = boto3.client("s3", **admin), boto3.client("iam", **admin)
    keys = {}
    for user, bucket, body in (
        ("worker", "internal", INTERNAL),
        ("payroll", "payroll-tools", TOOL),
    ):
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="tool.sh", Body=body)
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=_policy(bucket))
        made = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = S3Credentials(
            access_key_id=made["AccessKeyId"],
            secret_access_key=made["SecretAccessKey"],
            region="us-east-1",
        )
    # From now on every request is signed by a user's keys and held to its policy.
    enforce = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=b"0", headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(enforce, timeout=10).close()
    return keys


@pytest.fixture
def keys(
    iam_s3: tuple[str, dict[str, S3Credentials]], monkeypatch: pytest.MonkeyPatch
) -> dict[str, S3Credentials]:
    endpoint, made = iam_s3
    worker = made["worker"]
    for name, value in {
        "AWS_ACCESS_KEY_ID": worker.access_key_id,
        "AWS_SECRET_ACCESS_KEY": worker.secret_access_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "CAIRN_S3_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    return made


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
    assert not list((tmp_path / "cache").rglob("*"))  # nothing was fetched


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


def test_an_http_endpoint_in_credentials_needs_insecure_http(
    tmp_path: Path, keys: dict[str, S3Credentials]
) -> None:
    elsewhere = keys["payroll"].model_copy(update={"endpoint": "http://169.254.169.254"})
    with pytest.raises(ArtifactError, match="http:// endpoint is not allowed") as caught:
        _run(ArtifactCache(tmp_path / "c").fetch("s3://b/k", TOOL_SHA, credentials=elsewhere))
    assert caught.value.retryable is False
