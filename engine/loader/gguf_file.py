"""A GGUF file's header, read with bounds before anything else reads the file.

The ``gguf`` package and transformers' GGUF reader trust the counts, lengths and
offsets a header declares (a tensor count of ``2**60``, an array of ``2**40`` strings, a
tensor past the end of the file): :func:`read_header` checks each against the bytes
the file has before reading it, and refuses a malformed file with one
:class:`~pagedserve.engine.errors.ModelFileError` naming the file, what is wrong and the
limit. Nothing is allocated for a declared size; every loop is bounded by the file's
size. Torch-free.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.engine.errors import ModelFileError

VERSIONS = (2, 3)
MAX_DIMS = 4
"""A tensor's dimensions at most (GGML's ``GGML_MAX_DIMS``)."""
MAX_KEY_BYTES = 65535
"""A metadata key's length at most (the GGUF specification's)."""
MAX_TENSOR_NAME_BYTES = 64
"""A tensor name's length at most (GGML's ``GGML_MAX_NAME``)."""
MAX_ARRAY_DEPTH = 2
"""Arrays nested at most this deep (an array of arrays)."""
MAX_ARRAY_ITEMS = 1 << 24
"""An array's items at most (a vocabulary of 16M tokens)."""
MAX_KEPT_ITEMS = 1 << 16
"""Arrays of more items (outside ``tokenizer.``) are checked but not kept."""
MAX_COUNT = 1 << 20
"""Tensors, and metadata key/value pairs, at most."""
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
"""GGUF value types of fixed size and their struct formats."""
_MIN_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
"""The fewest bytes a value of each type takes (a string: its length; an array: its item
type and count)."""
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """GGML order: the row length first."""
    type_name: str
    offset: int
    """From the start of the file."""
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, object] = field(default_factory=dict)
    """Metadata values (strings, numbers, lists of them); ``tokenizer.`` arrays are checked
    but not kept."""
    tensors: list[TensorInfo] = field(default_factory=list)


class _Cursor:
    """Reads the header's values in order, each checked against the file's end."""

    def __init__(self, path: Path, buf, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"GGUF file {str(self.path)!r}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, past the end of the "
                            f"file ({self.size} bytes): the file is truncated or corrupt")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str, limit: int | None = None, keep: bool = True) -> str | None:
        n = self.scalar("<Q", f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long; the limit is {limit}")
        self.need(n, f"{what} ({n} bytes)")
        start, self.pos = self.pos, self.pos + n
        if not keep:
            return None
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not UTF-8") from None

    def count(self, n: int, min_bytes: int, what: str, limit: int) -> None:
        """``n`` items of at least ``min_bytes`` each must fit in the rest of the file and
        be at most ``limit``."""
        if n > limit:
            raise self.fail(f"{what}: {n} declared; the limit is {limit}")
        room = (self.size - self.pos) // min_bytes
        if n > room:
            raise self.fail(f"{what}: {n} declared, but the {self.size - self.pos} bytes left "
                            f"in the file hold at most {room}: the file is truncated or corrupt")

    def value(self, kind: int, key: str, keep: bool, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], f"the value of {key}")
        if kind == _STRING:
            return self.string(f"the string value of {key}", keep=keep)
        if kind != _ARRAY:
            raise self.fail(f"{key} has value type {kind}, not a GGUF value type (0 to 12)")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{key}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item = self.scalar("<I", f"the item type of {key}")
        n = self.scalar("<Q", f"the length of {key}")
        if item not in _MIN_BYTES:
            raise self.fail(f"{key} is an array of value type {item}, not a GGUF value type "
                            "(0 to 12)")
        self.count(n, _MIN_BYTES[item], f"the array {key}", MAX_ARRAY_ITEMS)
        keep = keep and n <= MAX_KEPT_ITEMS
        if item in _SCALARS and not keep:
            self.pos += n * _MIN_BYTES[item]
            return None
        out = [self.value(item, key, keep, depth + 1) for _ in range(n)]
        return out if keep else None


def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, weights a block, bytes a block)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (GGMLQuantizationType(t).name, b, s) for t, (b, s) in GGML_QUANT_SIZES.items()}


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file at ``path``, every count, length, dimension and offset
    checked against the file's size (:class:`ModelFileError` when one is out of bounds).

    Read once per file version: a load asks for it several times (the settings, the
    tokenizer, the weights), and a walk over a 262,144-token vocabulary takes a quarter
    of a second. The header returned is shared: callers read it, never change it."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return _read_file(path)  # the open says what is wrong
    return _cached_header(str(path), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_header(path: str, inode: int, size: int, mtime_ns: int) -> GGUFHeader:
    """:func:`_read_file` of one version of a file (its inode, size and time of change)."""
    return _read_file(Path(path))


def _read_file(path: Path) -> GGUFHeader:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ModelFileError(f"GGUF file {str(path)!r} is {size} bytes long: too short for "
                                 "a GGUF header (24 bytes at least)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            view = memoryview(buf)
            try:
                return _read(path, view, size)
            finally:
                view.release()


def _read(path: Path, buf, size: int) -> GGUFHeader:
    c = _Cursor(path, buf, size)
    if bytes(buf[:4]) != b"GGUF":
        raise c.fail(f"starts with {bytes(buf[:4])!r}, not the GGUF magic b'GGUF'")
    c.pos = 4
    version = c.scalar("<I", "the version")
    if version not in VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        what = "big-endian files are not supported" if swapped in VERSIONS else \
            f"supported: {', '.join(map(str, VERSIONS))}"  # fmt: skip
        raise c.fail(f"GGUF version {version}: {what}")
    n_tensors = c.scalar("<Q", "the tensor count")
    n_kv = c.scalar("<Q", "the metadata count")
    c.count(n_kv, _MIN_KV_BYTES, "metadata key/value pairs", MAX_COUNT)
    header = GGUFHeader(version)
    for _ in range(n_kv):
        key = c.string("a metadata key", MAX_KEY_BYTES)
        if key in header.fields:
            raise c.fail(f"the metadata key {key!r} appears twice")
        kind = c.scalar("<I", f"the value type of {key}")
        keep = not key.startswith("tokenizer.") or kind != _ARRAY
        header.fields[key] = c.value(kind, key, keep)
    c.count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensors", MAX_COUNT)
    types = _ggml_types()
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name", MAX_TENSOR_NAME_BYTES)
        n_dims = c.scalar("<I", f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions; the limit is {MAX_DIMS}")
        shape = tuple(c.scalar("<Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims))
        kind = c.scalar("<I", f"the type of tensor {name!r}")
        offset = c.scalar("<Q", f"the offset of tensor {name!r}")
        infos.append((name, shape, kind, offset))
    alignment = header.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise c.fail(f"general.alignment={alignment!r} is not a power of two")
    data = -(-c.pos // alignment) * alignment
    header.tensors = _tensors(c, infos, types, alignment, data)
    return header


def _tensors(c: _Cursor, infos, types, alignment: int, data: int) -> list[TensorInfo]:
    """The tensors' byte ranges, each checked to lie in the data section and apart from
    the others."""
    out: list[TensorInfo] = []
    names: set[str] = set()
    for name, shape, kind, offset in infos:
        if name in names:
            raise c.fail(f"the tensor name {name!r} appears twice")
        names.add(name)
        if kind not in types:
            raise c.fail(f"tensor {name!r} has GGML type {kind}, which is not known")
        type_name, block, block_bytes = types[kind]
        elements = 1
        for d in shape:
            elements *= d
        if elements >= 2**63:
            raise c.fail(f"tensor {name!r} of shape {list(shape)} has {elements} elements; "
                         "the limit is 2**63 - 1")
        if shape and shape[0] % block:
            raise c.fail(f"tensor {name!r} ({type_name}): its rows of {shape[0]} weights are "
                         f"not whole blocks of {block}")
        nbytes = elements // block * block_bytes
        if offset % alignment:
            raise c.fail(f"tensor {name!r} has offset {offset}, not a multiple of the "
                         f"alignment {alignment}")
        start = data + offset
        if start + nbytes > c.size:
            raise c.fail(f"tensor {name!r} ({type_name}, shape {list(shape)}) takes bytes "
                         f"{start} to {start + nbytes}, past the end of the file ({c.size} "
                         "bytes): the file is truncated or corrupt")
        out.append(TensorInfo(name, shape, type_name, start, nbytes))
    ordered = sorted(out, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.offset < a.offset + a.nbytes:
            raise c.fail(f"tensors {a.name!r} (bytes {a.offset} to {a.offset + a.nbytes}) and "
                         f"{b.name!r} (from {b.offset}) overlap")
    return out
