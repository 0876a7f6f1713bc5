"""What the CLI prints of others' words (cairn/output.py): controls, bidirectional
reordering and rich markup all shown, never acted on."""

from __future__ import annotations

import pytest

from cairn.output import safe, visible


@pytest.mark.parametrize(
    ("written", "shown"),
    [
        ("plain\ttext\n", "plain\ttext\n"),
        ("\x1b]52;c;aGFja2Vk\x07", "\\x1b]52;c;aGFja2Vk\\x07"),
        ("\u009b2J", "\\x9b2J"),
        # "Trojan Source": an override that makes "nightly-gpj.exe" read as "nightly-exe.jpg"
        ("nightly-\u202egpj.exe", "nightly-\\u202egpj.exe"),
        ("a\u2066b\u2069c\u200fd\u061c", "a\\u2066b\\u2069c\\u200fd\\u061c"),
        ("déjà vu ✓ 日本", "déjà vu ✓ 日本"),  # letters of any script stay as written
    ],
)
def test_controls_and_reordering_are_shown_as_escapes(written: str, shown: str) -> None:
    assert visible(written) == shown


def test_markup_is_shown_not_rendered() -> None:
    assert safe("[link=https://evil.example]x[/link]\u202e") == (
        "\\[link=https://evil.example]x\\[/link]\\u202e"
    )
