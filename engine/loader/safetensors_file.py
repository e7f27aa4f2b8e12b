"""A safetensors file's header, checked with bounds before the file is opened for its
tensors.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor:
``dtype``, ``shape``, ``data_offsets`` into the data section) and the data section.
:func:`read_header` checks the length against the file's size before reading the
header, and every tensor's byte range against its dtype and shape, the data section and
the other tensors: a malformed file is refused with one
:class:`~pagedserve.engine.errors.ModelFileError` naming the file, what is wrong and the
limit, and nothing is allocated for a declared size. Torch-free.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.errors import ModelFileError

MAX_HEADER_BYTES = 100_000_000
"""A header's size at most (the ``safetensors`` package's own limit)."""
MAX_DIMS = 64
"""A tensor's dimensions at most."""
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
              "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6}  # fmt: skip
"""Bits an element of each safetensors dtype takes."""


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """From the start of the data section."""
    end: int


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors the safetensors file at ``path`` holds, its header checked: its length
    against the file, its JSON, and every tensor's dtype, shape and byte range
    (:class:`ModelFileError` when one is wrong)."""
    path = Path(path)

    def fail(what: str) -> ModelFileError:
        return ModelFileError(f"safetensors file {str(path)!r}: {what}")

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise fail(f"{size} bytes long: too short for the 8-byte header length")
        f.seek(0)
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise fail(f"its header length field says {n} bytes; the limit is "
                       f"{MAX_HEADER_BYTES}")
        if n > size - 8:
            raise fail(f"its header length field says {n} bytes, but only {size - 8} follow "
                       "it: the file is truncated or corrupt")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise fail("its header is JSON nested too deeply (a header is an object of tensor "
                   "entries)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise fail(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise fail(f"its header is a JSON {type(header).__name__}, not an object")
    entries = {name: _entry(fail, name, info) for name, info in header.items()
               if name != "__metadata__"}  # fmt: skip
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail("its __metadata__ is not an object of strings")
    _check_ranges(fail, entries, size - 8 - n)
    return entries


def _entry(fail, name: str, info) -> TensorEntry:
    """One tensor's entry, its dtype, shape and data offsets checked for type, and its
    byte range against its dtype and shape."""
    if not isinstance(info, dict):
        raise fail(f"the entry of tensor {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise fail(f"tensor {name!r} has dtype {dtype!r}, not a safetensors dtype "
                   f"({', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise fail(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if len(shape) > MAX_DIMS:
        raise fail(f"tensor {name!r} has {len(shape)} dimensions; the limit is {MAX_DIMS}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)):  # fmt: skip
        raise fail(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if end < begin:
        raise fail(f"tensor {name!r} has data_offsets [{begin}, {end}]: its end is before "
                   "its begin")
    elements = 1
    for d in shape:
        elements *= d
    bits = elements * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        size = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits"
        raise fail(f"tensor {name!r} of dtype {dtype} and shape {shape} takes {size}, but its "
                   f"data_offsets [{begin}, {end}] span {end - begin} bytes")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_ranges(fail, entries: dict[str, TensorEntry], data: int) -> None:
    """Every tensor's bytes lie in the data section (``data`` bytes), apart from the
    others', and together they fill it (as the ``safetensors`` package requires)."""
    for e in entries.values():
        if e.end > data:
            raise fail(f"tensor {e.name!r} has data_offsets [{e.begin}, {e.end}], past the end "
                       f"of the data section ({data} bytes): the file is truncated or corrupt")
    at = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < at:
            raise fail(f"tensor {e.name!r} (bytes {e.begin} to {e.end}) overlaps the tensor "
                       f"before it (which ends at {at})")
        if e.begin > at:
            raise fail(f"bytes {at} to {e.begin} of the data section belong to no tensor")
        at = e.end
    if at != data:
        raise fail(f"bytes {at} to {data} of the data section belong to no tensor")
