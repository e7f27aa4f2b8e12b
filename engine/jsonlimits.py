"""Bounded JSON decoding, for JSON text that a client or a file supplies.

Every JSON text the server or the engine decodes itself (a schema or tool-call arguments
sent as a string, an adapter's ``adapter_config.json`` and safetensors header, a model's
small JSON files) goes through :func:`decode_json` or :func:`read_json_file`: the text
is at most ``max_size`` long, nested at most ``max_depth`` levels, and strict JSON (no
``NaN`` or ``Infinity``, no number past float64, no lone surrogate). Anything else is a
:class:`~pagedserve.engine.errors.JSONTextError` naming the field and the limit, never a
``RecursionError``. Torch-free.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from pagedserve.engine.errors import JSONTextError

MAX_DEPTH = 128
"""The most levels of arrays and objects inside one another."""
MAX_SIZE = 4 * 2**20
"""The longest text decoded by default (characters of a string, bytes otherwise)."""
MAX_FILE_BYTES = 16 * 2**20
"""The largest JSON file read by default."""
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)


def decode_json(text: str | bytes, field: str, *, max_size: int = MAX_SIZE,
                max_depth: int = MAX_DEPTH) -> Any:  # fmt: skip
    """The value of the JSON ``text``; a :class:`JSONTextError` naming ``field`` when it
    is malformed or past ``max_size`` or ``max_depth``."""
    unit = "characters" if isinstance(text, str) else "bytes"
    if len(text) > max_size:
        raise JSONTextError(f"{field} is {len(text)} {unit} long; the limit is {max_size} "
                            f"{unit}", field)
    try:
        value = msgspec.json.decode(text)
    except RecursionError:
        raise _too_deep(field, max_depth) from None
    except msgspec.ValidationError:
        raise JSONTextError(f"{field} has a number out of range: a number may not be past "
                            "float64's range, nor an integer longer than 4300 digits",
                            field) from None
    except msgspec.DecodeError as e:
        at = _lone_surrogate(text if unit == "characters" else
                             bytes(text).decode("utf-8", "replace"))
        why = str(e) if at is None else (f"the \\u escape at character {at} is a lone "
                                         "surrogate (U+D800 to U+DFFF without its pair)")
        raise JSONTextError(f"{field} is not valid JSON: {why}", field) from None
    if _deeper_than(value, max_depth):
        raise _too_deep(field, max_depth)
    return value


def read_json_file(path: str | Path, *, max_bytes: int = MAX_FILE_BYTES,
                   max_depth: int = MAX_DEPTH) -> Any:  # fmt: skip
    """The value of the JSON file at ``path`` (at most ``max_bytes`` of it are read); an
    ``OSError`` when it cannot be read, a :class:`JSONTextError` naming it otherwise."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JSONTextError(f"{path} is larger than the limit of {max_bytes} bytes",
                            str(path))
    return decode_json(data, str(path), max_size=max_bytes, max_depth=max_depth)


def read_json_object(path: str | Path, error: type[Exception]) -> dict:
    """The JSON object in the file at ``path``; ``error`` naming the file when it cannot
    be read, is not JSON within the limits of :func:`read_json_file`, or is not an
    object."""
    try:
        value = read_json_file(path)
    except (OSError, JSONTextError) as e:
        raise error(f"{path} cannot be read as a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{path} is not a JSON object")
    return value


def _lone_surrogate(text: str) -> int | None:
    """Where the first ``\\u`` escape of a lone surrogate starts in ``text``, if any."""
    pending = None  # (offset, end) of a high surrogate's escape
    for m in _ESCAPE.finditer(text):
        code = int(m.group(1), 16) if m.group(1) else None
        if pending is not None:
            if code is None or not 0xDC00 <= code <= 0xDFFF or m.start() != pending[1]:
                return pending[0]
            pending = None
        elif code is not None and 0xDC00 <= code <= 0xDFFF:
            return m.start()
        elif code is not None and 0xD800 <= code <= 0xDBFF:
            pending = (m.start(), m.end())
    return None if pending is None else pending[0]


def _too_deep(field: str, max_depth: int) -> JSONTextError:
    return JSONTextError(f"{field} is nested too deeply: arrays and objects may be nested "
                         f"at most {max_depth} levels", field)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` has arrays and objects nested more than ``limit`` levels (level by
    level: a list operation per container, not a stack entry per value)."""
    level = [value] if type(value) is list or type(value) is dict else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        items: list = []
        for v in level:
            items += v.values() if type(v) is dict else v
        level = [x for x in items if type(x) is list or type(x) is dict]
    return False
