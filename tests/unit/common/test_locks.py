"""Advisory lock keys: one module names them all, and no two uses share one."""

from __future__ import annotations

import re
from pathlib import Path

from libs.common import locks

ROOT = Path(__file__).resolve().parents[3]


def test_no_two_uses_share_a_key() -> None:
    pairs = [(k >> 32, k & 0xFFFFFFFF) for k in locks.ALL_BIGINTS]
    assert len(set(pairs)) == len(pairs)
    classes = set(locks.ALL_CLASSES)
    assert len(classes) == len(locks.ALL_CLASSES)
    # A bigint key's high half is the class it would clash with.
    assert not classes & {high for high, _ in pairs}
    singletons = [locks.PLACEMENT_PASS, locks.MATCHER, locks.DEADLINE_SCAN]
    assert len(set(singletons)) == len(singletons)
    assert {cls for cls, _ in singletons} == {locks.CORE}


def test_every_key_taken_is_named_in_the_locks_module() -> None:
    """A number written into a lock call elsewhere is a key the module does not know."""
    call = re.compile(r"pg_(?:try_)?advisory_(?:xact_)?lock\(\s*(?:\d|0x)")
    strays = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("services", "libs", "cairn")
        for path in (ROOT / top).rglob("*.py")
        if "migrations/versions" not in str(path)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if call.search(line)
    ]
    assert strays == []
