"""How the CLI talks back: rich tables on a terminal, JSON with ``--json``, and a service's
problem+json turned into one clear line and exit status 1.

Whatever a service answers may have been written by someone else (a task's log, a task's
or a schedule's name, an error, a webhook's answer), so it reaches the terminal only
through :func:`visible` (plain text) or :func:`safe` (inside rich markup)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from libs.common.errors import CairnError

T = TypeVar("T")

# Piped output keeps whole lines (rich would fold them at 80 columns).
console = Console() if sys.stdout.isatty() else Console(width=200)
errors = Console(stderr=True, soft_wrap=True)

# Every control character but newline and tab: C0, DEL and C1. ESC (and CSI, 0x9b) start
# the sequences that write the clipboard (OSC 52), clear the screen or retitle the window.
# And the bidirectional controls (embeddings, overrides, isolates, marks), which reorder
# what follows them on the line ("Trojan Source"): a name that reads as another's.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` made harmless for a terminal: each control character but newline and tab
    shown as its escape (ESC as ``\\x1b``, a right-to-left override as ``\\u202e``), so
    what a task or another user wrote cannot move the cursor, clear the screen, retitle the
    window, write the clipboard or reorder the line."""
    return _CONTROL.sub(_escape, text)


def safe(value: object) -> str:
    """``value`` as plain text to put inside rich markup: :func:`visible`, and its square
    brackets escaped, so it can neither style the line nor make a link."""
    return escape(visible(str(value)))


class Markup(str):
    """Rich markup the CLI wrote itself (a state in its colour): a table cell of this type
    is rendered as markup, every other cell as plain text through :func:`safe`."""


STATE_STYLE = {
    "succeeded": "green",
    "running": "cyan",
    "waiting": "yellow",
    "ready": "blue",
    "queued": "blue",
    "failed": "red",
    "dead": "bold red",
    "cancelled": "magenta",
    "cancelling": "magenta",
    "upstream_failed": "red",
    "skipped": "dim",
    "pending": "dim",
    "submitted": "green",
    "missed": "yellow",
    "skipped_overlap": "yellow",
    "progressing": "yellow",
    "complete": "green",
    "rolled_back": "red",
}


def call(work: Callable[[], Awaitable[T]]) -> T:
    """Run one async API call; a problem answer or an unreachable service ends the command
    with a message naming it."""
    try:
        return asyncio.run(_call(work))
    except CairnError as exc:
        fields = exc.extra.get("errors") or []
        errors.print(f"[red]error[/red] {exc.status}: {safe(exc.detail)}")
        for field in fields[:20]:
            errors.print(f"  {safe(field.get('field'))}: {safe(field.get('reason'))}")
        raise typer.Exit(1) from None
    except httpx.TransportError as exc:
        url = exc.request.url if exc.request else "the service"
        errors.print(f"[red]error[/red] cannot reach {safe(url)}: {safe(exc)}")
        raise typer.Exit(2) from None


async def _call(work: Callable[[], Awaitable[T]]) -> T:
    return await work()


def dump(value: Any) -> None:
    """Print ``value`` (models, lists of models, plain data) as JSON."""

    def plain(item: Any) -> Any:
        if isinstance(item, BaseModel):
            return item.model_dump(mode="json")
        if isinstance(item, list | tuple):
            return [plain(i) for i in item]
        if isinstance(item, dict):
            return {k: plain(v) for k, v in item.items()}
        return item

    sys.stdout.write(json.dumps(plain(value), indent=2, default=str) + "\n")


def state(value: str | None) -> Markup:
    """A state (or an outcome) in its colour."""
    if value is None:
        return Markup("")
    text = str(value)
    style = STATE_STYLE.get(text)
    return Markup(f"[{style}]{safe(text)}[/{style}]" if style else safe(text))


def when(value: datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def ago(value: datetime | None) -> str:
    if value is None:
        return ""
    seconds = (datetime.now(UTC) - value).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if abs(seconds) >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table of ``rows``: each cell plain text (:func:`safe`) but a :class:`Markup` one."""
    grid = Table(title=safe(title) if title else None, title_justify="left", header_style="bold")
    for column in columns:
        grid.add_column(column, overflow="fold")
    for row in rows:
        grid.add_row(*(_cell(v) for v in row))
    console.print(grid)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, Markup) else safe(value)


def pairs(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` options as a map; a malformed one ends the command."""
    found: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            errors.print(f"[red]error[/red] {safe(repr(item))} is not KEY=VALUE")
            raise typer.Exit(2)
        found[key] = value
    return found
