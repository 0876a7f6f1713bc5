"""The API docs' vendored script (libs/common/pages.py): served only as reviewed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from libs.common import pages, problems


def _get(path: str) -> httpx.Response:
    app = pages.service_app(title="t")
    problems.install(app)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
            return await http.get(path)

    return asyncio.run(go())


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    pages._asset.cache_clear()
    yield
    pages._asset.cache_clear()


def test_the_vendored_files_are_the_reviewed_ones() -> None:
    for name in pages.VENDORED:
        answer = _get(f"/docs/static/{name}")
        assert answer.status_code == 200, name
        assert answer.headers["etag"] == f'"{pages.VENDORED[name][:32]}"'


def test_a_changed_file_is_refused_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(pages.VENDORED, "swagger-ui-bundle.js", "0" * 64)
    answer = _get("/docs/static/swagger-ui-bundle.js")
    assert answer.status_code == 503
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert "not the reviewed file" in answer.json()["detail"]
    assert _get("/docs/static/swagger-ui.css").status_code == 200
