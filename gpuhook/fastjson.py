"""JSON for the hook's GPU path, without importing the json package.

``import json`` pulls in re and enum: about 5 ms on every container start that wants a GPU,
more than everything the hook decides. This module drives CPython's C accelerator ``_json``
(the same scanner and encoder json itself uses) directly, so results are identical; where
``_json`` is missing (another Python), it falls back to the json package.
tests/unit/test_fastjson.py checks it against json on generated documents.
"""

try:
    import _json
except ImportError:  # pragma: no cover - CPython always has it
    _json = None

_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}
_WHITESPACE = " \t\n\r"


class _Context:
    """The attributes _json.make_scanner reads from a JSONDecoder."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WHITESPACE:
        i += 1
    return i


def loads(text, object_pairs_hook=None):
    """Parse one JSON document (str or UTF-8 bytes); raises ValueError like json.loads.
    `object_pairs_hook` builds each object from its (key, value) pairs, as in json."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    if _json is None:
        import json

        return json.loads(text, object_pairs_hook=object_pairs_hook)
    if text.startswith("\ufeff"):
        raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0)")
    context = _Context
    if object_pairs_hook is not None:
        context = type("_PairsContext", (_Context,), {"object_pairs_hook": staticmethod(object_pairs_hook)})
    scan = _json.make_scanner(context)
    start = _skip(text, 0)
    try:
        value, end = scan(text, start)
    except StopIteration as err:
        raise ValueError(f"Expecting value: {_where(text, err.value)}") from None
    except SystemError:
        # The C scanner builds its error from json.decoder, but only if something imported
        # json already; otherwise it fails without one. Errors are rare: let json say it.
        import json

        return json.loads(text, object_pairs_hook=object_pairs_hook)
    end = _skip(text, end)
    if end != len(text):
        raise ValueError(f"Extra data: {_where(text, end)}")
    return value


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"line {line} column {column} (char {pos})"


def _default(value):
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def dumps(value, default=None) -> str:
    """Compact JSON text (separators "," and ":"), ASCII only, like json.dumps(..., separators=(",", ":"))."""
    if _json is None:
        import json

        return json.dumps(value, separators=(",", ":"), default=default)
    encode = _json.make_encoder(
        {}, default or _default, _json.encode_basestring_ascii, None, ":", ",", False, False, True,
    )
    return "".join(encode(value, 0))
