"""The pools read json and jsonb by orjson (``database.json_loads``), which reads an integer
beyond 64 bits as a float: such a value must come back as the standard library reads it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.common.database import json_loads

_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_VALUES)
def test_every_value_reads_as_the_standard_library_reads_it(value: object) -> None:
    text = json.dumps(value)
    for data in (text.encode(), memoryview(text.encode()), text):
        got = json_loads(data)
        assert got == json.loads(text)
        assert json.dumps(got) == json.dumps(json.loads(text))  # ints stay ints


@pytest.mark.parametrize(
    "text",
    [
        "18446744073709551616",  # 2**64: orjson alone gives 1.8446744073709552e+19
        "-9223372036854775809",  # below -2**63
        '{"n": [123456789012345678901234567890]}',
        '{"big": 1e400}',
        '"\\u00e9 1234567890123456789"',
    ],
)
def test_what_orjson_reads_otherwise_is_read_by_the_standard_library(text: str) -> None:
    got = json_loads(text.encode())
    assert got == json.loads(text) and type(got) is type(json.loads(text))
    assert json.dumps(got) == json.dumps(json.loads(text))
