"""The native library's interface, read from its one declaration, ``csrc/abi.h``.

The header declares the constants the C code shares with Python (KV cache dtype codes,
quantization format codes, ``QK``, ``MAX_HEAD_DIM``, paged_attention's status codes
and their messages) and the prototype of every exported function; the C sources
include it, so the compiler holds each definition to its prototype. This module parses
the same text, so nothing is declared twice: :data:`CONSTANTS` are the header's
``#define`` values, :data:`SIGNATURES` the ctypes ``(restype, argtypes)`` of each
prototype, and :func:`declare` gives them to a loaded library. It needs neither torch nor
a compiler: the torch reference of the quantized formats reads its constants here too.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).with_name("csrc") / "abi.h"

_DEFINE = re.compile(r"^#define\s+([A-Z][A-Z0-9_]*)\s+(-?\d+)\s*(?:/\*\s*(.*?)\s*\*/)?\s*$",
                     re.MULTILINE)  # fmt: skip
_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_PROTOTYPE = re.compile(r"^(?P<ret>[\w\s]+?\**)\s*\b(?P<name>\w+)\s*\((?P<args>[^()]*)\)$",
                        re.DOTALL)  # fmt: skip
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _ctype(decl: str, is_return: bool = False) -> type | None:
    """The ctypes type of a C parameter or return type (``const`` and names ignored)."""
    words = decl.replace("*", " * ").split()
    if "*" in words:
        if is_return and words[:3] == ["const", "char", "*"]:
            return ctypes.c_char_p
        return ctypes.c_void_p
    base = [w for w in words if w != "const"]
    if is_return and base == ["void"]:
        return None
    if not is_return:
        base = base[:-1]  # the parameter's name
    if len(base) != 1 or base[0] not in _SCALARS:
        raise ValueError(f"{HEADER.name}: cannot map the C type of {decl!r} to ctypes")
    return _SCALARS[base[0]]


def parse(text: str) -> tuple[dict[str, int], dict[str, str], dict[str, tuple]]:
    """``(constants, messages, signatures)`` of a header in the form of ``abi.h``:
    messages are the comments after constants (constant names in them replaced by
    their values), signatures ``name -> (restype, [argtypes])``."""
    constants = {m[1]: int(m[2]) for m in _DEFINE.finditer(text)}
    names = re.compile(r"\b(" + "|".join(map(re.escape, constants)) + r")\b")
    messages = {m[1]: names.sub(lambda n: str(constants[n[1]]), m[3])
                for m in _DEFINE.finditer(text) if m[3]}  # fmt: skip
    code = "\n".join(line for line in _COMMENT.sub(" ", text).splitlines()
                     if not line.lstrip().startswith("#"))  # fmt: skip
    signatures: dict[str, tuple] = {}
    for decl in filter(None, (" ".join(d.split()) for d in code.split(";"))):
        m = _PROTOTYPE.match(decl)
        if m is None:
            raise ValueError(f"{HEADER.name}: not a prototype: {decl!r}")
        args = [a.strip() for a in m["args"].split(",")]
        argtypes = [] if args == ["void"] else [_ctype(a) for a in args]
        signatures[m["name"]] = (_ctype(m["ret"], is_return=True), argtypes)
    return constants, messages, signatures


CONSTANTS, _MESSAGES, SIGNATURES = parse(HEADER.read_text(encoding="utf-8"))
"""The header's ``#define`` constants; the ctypes signature of each exported function."""

DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_I8 = (
    CONSTANTS[n] for n in ("DTYPE_F32", "DTYPE_BF16", "DTYPE_F16", "DTYPE_I8"))
"""KV cache element type codes."""
KV_I8_SCALE_BYTES = CONSTANTS["KV_I8_SCALE_BYTES"]
"""Bytes after an int8 cache row's codes: its float32 scale."""
KV_ROWS_FIRST, KV_HEADS_FIRST = CONSTANTS["KV_ROWS_FIRST"], CONSTANTS["KV_HEADS_FIRST"]
"""KV cache layout codes: a block's rows, then heads; or its heads, then rows."""
I8_DOTS_MADDUBS, I8_DOTS_VNNI, I8_DOTS_VNNI512 = (
    CONSTANTS[n] for n in ("I8_DOTS_MADDUBS", "I8_DOTS_VNNI", "I8_DOTS_VNNI512"))
"""The 8-bit-activation products' kinds of integer dot (bits of a set)."""
QK = CONSTANTS["QK"]
"""Weights per block along k of the GGUF formats."""
MAX_HEAD_DIM = CONSTANTS["MAX_HEAD_DIM"]
"""The longest head the attention kernel and RoPE take."""
PAIR_SPLIT, PAIR_SILU, PAIR_GELU_TANH = (
    CONSTANTS[n] for n in ("PAIR_SPLIT", "PAIR_SILU", "PAIR_GELU_TANH"))
"""``gemm_f32_pair``'s modes: the plain product, or SiLU's or GELU-tanh's gate of it."""
QUANT_FORMATS: dict[str, int] = dict(sorted(
    ((name.removeprefix("QF_").lower(), code) for name, code in CONSTANTS.items()
     if name.startswith("QF_")), key=lambda item: item[1]))  # fmt: skip
"""Quantization format name (``q8_0``, ``q4_0``, ``q4_1``, ``int8``, ``q5_0``, ``q5_1``,
``q4_k``, ``q5_k``, ``q6_k``) -> code, in code order."""
QK_K = CONSTANTS["QK_K"]
"""Weights per block along k of the GGUF K-quants."""
BLOCK_BYTES: dict[str, int] = {name.removeprefix("QB_").lower(): size
                               for name, size in CONSTANTS.items()
                               if name.startswith("QB_")}  # fmt: skip
"""Bytes of one GGML block of each format kept as the file's blocks (one plane)."""
ATTENTION_ERRORS: dict[int, str] = {CONSTANTS[name]: text for name, text in _MESSAGES.items()
                                    if name.startswith("PA_ERR_")}  # fmt: skip
"""paged_attention's status codes -> what each means."""
DECODER_ERRORS: dict[int, str] = {CONSTANTS[name]: text for name, text in _MESSAGES.items()
                                  if name.startswith(("PA_ERR_", "DEC_ERR_"))}  # fmt: skip
"""decoder_layers' status codes (paged_attention's and its own) -> what each means."""


def declare(lib: ctypes.CDLL) -> None:
    """Set ``restype`` and ``argtypes`` of every function the header declares."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
