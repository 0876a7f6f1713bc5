"""The object store that holds ended attempts' logs when ``CAIRN_LOG_STORE=s3``: any
S3-compatible service (AWS, MinIO, Ceph; moto in the tests), through boto3, whose calls
run in threads so the event loop never waits on them. Credentials come from boto3's
usual chain (environment, profile, instance role)."""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Sequence
from typing import Any

from services.core.settings import CoreSettings

_DELETE_MAX = 1000  # S3's DeleteObjects limit


class LogObjects:
    """One object per ended attempt, ``PREFIX{task_id}/{attempt_id}.log``."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self._endpoint_url = endpoint_url
        self._client: Any = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: CoreSettings) -> LogObjects | None:
        if settings.log_store != "s3" or settings.log_s3_bucket is None:
            return None
        return cls(settings.log_s3_bucket, settings.log_s3_prefix, settings.log_s3_endpoint_url)

    def key(self, task_id: int, attempt_id: int) -> str:
        return f"{self.prefix}{task_id}/{attempt_id}.log"

    async def put(
        self, key: str, data: bytes, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        await asyncio.to_thread(
            lambda: self._s3().put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentType=content_type
            )
        )

    async def read(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of the object."""
        if end <= start:
            return b""

        def get() -> bytes:
            answer = self._s3().get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
            )
            body: bytes = answer["Body"].read()
            return body

        return await asyncio.to_thread(get)

    async def delete(self, keys: Sequence[str]) -> None:
        def delete(batch: list[dict[str, str]]) -> None:
            self._s3().delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

        for i in range(0, len(keys), _DELETE_MAX):
            await asyncio.to_thread(delete, [{"Key": key} for key in keys[i : i + _DELETE_MAX]])

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _s3(self) -> Any:
        with self._lock:
            if self._client is None:
                boto3 = importlib.import_module("boto3")
                self._client = boto3.session.Session().client("s3", endpoint_url=self._endpoint_url)
            return self._client
