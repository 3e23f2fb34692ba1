"""gpuhook.fastjson gives exactly what json gives, on any document."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhook import fastjson

documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(documents)
def test_round_trip_matches_json(doc):
    text = json.dumps(doc)
    assert fastjson.loads(text) == json.loads(text)
    assert fastjson.dumps(doc) == json.dumps(doc, separators=(",", ":"))
    assert fastjson.loads(fastjson.dumps(doc)) == doc


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=40))
def test_errors_match_json(text):
    try:
        expected = json.loads(text)
    except ValueError as err:
        with pytest.raises(ValueError) as ours:
            fastjson.loads(text)
        assert str(ours.value) == str(err)
    else:
        assert fastjson.loads(text) == expected or expected != expected  # NaN


@pytest.mark.parametrize("text", ["", " ", "{", "[1,]", '{"a":1}x', "\ufeff{}", "nul", '"\\x"'])
def test_malformed_documents_raise_value_error(text):
    with pytest.raises(ValueError):
        fastjson.loads(text)


def test_bytes_and_constants():
    assert fastjson.loads(b'{"a": [Infinity, -Infinity]}') == {"a": [float("inf"), float("-inf")]}
    assert fastjson.dumps({"k": "\u00e9\n"}) == '{"k":"\\u00e9\\n"}'
    with pytest.raises(TypeError, match="not JSON serializable"):
        fastjson.dumps({"k": object()})
    assert fastjson.dumps({"k": object()}, default=lambda o: "obj") == '{"k":"obj"}'
