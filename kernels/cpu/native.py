"""Native CPU kernels: built at first use, called through ctypes.

``csrc/`` holds plain C with OpenMP (no torch headers): the paged attention kernel
(decode rows and prefill chunks), fused element-wise layer ops and a float32 linear
layer for decode-sized batches. Each kernel is written once against ``csrc/simd.h``,
whose vector width is chosen at compile time, so one source builds at three levels
(:data:`LEVELS`): ``portable`` (``-march=x86-64``, or the compiler's default off x86:
plain C loops), ``avx2`` (``-march=x86-64-v3``: AVX2, FMA, F16C) and ``avx512``
(``-march=x86-64-v4``). The engine builds the best level this CPU runs (its
:class:`~pagedserve.kernels.settings.KernelSettings` may name a lower one: ``PAGEDSERVE_CPU_ISA``)
once, with the system C compiler (the settings' ``cc``, else ``cc``; 10-30 seconds on two
cores). The shared library is cached in the settings' kernel folder (the engine's
``$PAGEDSERVE_CACHE/kernels``, default ``~/.cache/pagedserve/kernels``), keyed by the
sources, the flags, the compiler's version and the CPU's feature flags, and written
atomically; processes that start at once (data-parallel replicas, tensor-parallel ranks)
build it once, the others waiting on a lock of the folder. The constants shared with C
and the ctypes signatures come from ``csrc/abi.h`` (:mod:`pagedserve.kernels.cpu.abi`). ctypes
releases the GIL for the duration of each call.

When there is no compiler or the build fails, :func:`load` returns ``None`` and says
why once in the log; the caller falls back to the pure torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import numbers
import operator
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.kernels.cpu import abi
from pagedserve.kernels.interface import KV_INT8_SCALE_BYTES, kv_row_width
from pagedserve.kernels.settings import KernelSettings

log = logging.getLogger("pagedserve.kernels.cpu.native")

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("paged_attention_cpu.c", "fused_ops_cpu.c", "gemm_cpu.c",
                                   "qgemm_cpu.c", "decoder_cpu.c", "pool.c",
                                   "shm_sync.c"))
HEADERS = tuple(CSRC / f for f in ("abi.h", "convert.h", "gated.h", "paged_attention_portable.h",
                                   "paged_attention_vec.h", "paged_attention_tiled.h",
                                   "paged_attention_tiled16.h",
                                   "paged_attention_write.h", "pool.h",
                                   "qgemm_blocks.h", "qgemm_dequant.h", "qgemm_i8.h",
                                   "qgemm_i8_kern.h", "qgemm_i8_wide.h", "qgemm_i8_portable.h",
                                   "qgemm_vec.h",
                                   "simd.h"))
# -std=c11 keeps floating-point contraction off: a * b + c rounds twice, as in torch.
BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-std=c11")
LEVELS = ("portable", "avx2", "avx512")
"""Build levels of the native library, slowest first; each names its vector path."""
ISA_SETTING = "PAGEDSERVE_CPU_ISA"
"""The name the user sets the build level by (the engine reads it), for messages."""
_X86_MARCH = {"portable": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
# What each x86-64 micro-architecture level promises (the CPU flags Linux reports).
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_LEVEL_FEATURES = {
    "portable": frozenset(),
    "avx2": _V3,
    "avx512": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
DTYPE_CODES = {torch.float32: abi.DTYPE_F32, torch.bfloat16: abi.DTYPE_BF16,
               torch.float16: abi.DTYPE_F16, torch.int8: abi.DTYPE_I8}  # fmt: skip
"""KV cache dtypes the attention kernel takes, and their codes (``csrc/abi.h``)."""

_lock = threading.Lock()
_libs: dict[tuple, ctypes.CDLL | None] = {}
"""Loaded libraries by (level, kernel folder, compiler)."""
_errors: dict[tuple | None, str] = {}
"""Why a load failed, by the same key (None: the latest failure)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``avx2``, ``avx512f``, ``amx_bf16``,
    ``asimd``, ...); empty where there is no ``/proc/cpuinfo``."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386", "x86")


def runnable_levels(features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The build levels this CPU can run (``portable`` always), slowest first."""
    if not is_x86():
        return ("portable",)
    have = cpu_features() if features is None else features
    return tuple(lv for lv in LEVELS if _LEVEL_FEATURES[lv] <= have)


def level_cflags(level: str) -> tuple[str, ...]:
    """The compiler flags of a build level (no ``-march`` off x86: the compiler's own
    baseline, where only the portable loops exist)."""
    if level not in LEVELS:
        raise ValueError(f"unknown CPU build level {level!r}; expected one of {LEVELS}")
    if not is_x86():
        return BASE_CFLAGS
    return (*BASE_CFLAGS, f"-march={_X86_MARCH[level]}", "-mtune=native")


def engine_level(wanted: str | None = None) -> str:
    """The level the engine builds: ``wanted`` if given (it must be one this CPU runs;
    the engine passes ``PAGEDSERVE_CPU_ISA``), else the best this CPU runs."""
    runnable = runnable_levels()
    wanted = (wanted or "").strip().lower()
    if not wanted:
        return runnable[-1]
    if wanted not in LEVELS:
        raise ValueError(f"{ISA_SETTING}={wanted!r}: expected one of {LEVELS}")
    if wanted not in runnable:
        raise ValueError(f"{ISA_SETTING}={wanted!r}: this CPU runs only {runnable}")
    return wanted


def _compiler(cc: str | None) -> str | None:
    return shutil.which(cc or "cc") or shutil.which("gcc")


def _build(cc: str, cflags: tuple[str, ...], kernel_dir: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256()
    parts = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(cflags).encode(), version.stdout.encode(),
                 platform.machine().encode(), _cpu_flags().encode()):  # fmt: skip
        key.update(part)
        key.update(b"\0")
    out = kernel_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(out.parent):  # processes starting at once build it once
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".so.tmp", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *cflags, *map(str, SOURCES), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, check=False)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("built the native CPU kernels: %s", out)
    return out


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` among processes (``flock`` on the folder itself, so
    no lock file is left behind); without ``fcntl`` (not POSIX) no lock: each process then
    builds its own copy and the last atomic rename wins."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_library(level: str, settings: KernelSettings | None = None) -> ctypes.CDLL:
    """Build (or find cached) and open the library at build ``level`` with the compiler
    and kernel folder of ``settings``; raises on failure.

    :func:`load` is the engine's entry point; tests build every level this CPU runs.
    """
    settings = settings or KernelSettings()
    cc = _compiler(settings.cc)
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC or install gcc)")
    lib = ctypes.CDLL(str(_build(cc, level_cflags(level), settings.kernel_dir)))
    abi.declare(lib)
    return lib


def isa(lib: ctypes.CDLL) -> str:
    """The vector path a built library runs: ``avx512``, ``avx2`` or ``portable``."""
    return lib.simd_isa().decode()


INT8_DOTS = {"maddubs": abi.I8_DOTS_MADDUBS, "vnni": abi.I8_DOTS_VNNI,
             "vnni512": abi.I8_DOTS_VNNI512}  # fmt: skip
"""The kinds of integer dot the 8-bit-activation products have, and their codes:
maddubs and VNNI at 256 bits, VNNI at 512 (AVX-512 builds: two column groups a vector)."""
_INT8_DOTS_CPU = {"avx2": "avx_vnni", "avx512": "avx512_vnni"}
"""The CPU flag each vector level's VNNI copy needs (AVX-VNNI's VEX encoding on AVX2
builds; AVX-512 VNNI's EVEX one, at 256 bits, on AVX-512 builds)."""


def int8_dots_built(lib: ctypes.CDLL) -> tuple[str, ...]:
    """The kinds of integer dot ``lib``'s 8-bit products were built with (none on the
    portable build; ``vnni`` where the compiler has the level's encoding, ``vnni512`` with
    it on AVX-512 builds)."""
    built = lib.qgemm_i8_dots_built()
    return tuple(name for name, code in INT8_DOTS.items() if built & code)


def int8_dots_available(lib: ctypes.CDLL) -> tuple[str, ...]:
    """Those of :func:`int8_dots_built` this CPU runs (``vnni`` and ``vnni512`` need the
    level's flag: ``avx_vnni`` on AVX2 builds, ``avx512_vnni`` on AVX-512 builds)."""
    flag = _INT8_DOTS_CPU.get(isa(lib))
    return tuple(d for d in int8_dots_built(lib)
                 if d == "maddubs" or (flag is not None and flag in cpu_features()))  # fmt: skip


def int8_dots(lib: ctypes.CDLL) -> str | None:
    """The integer dots ``lib``'s 8-bit products use now (None: the portable build's
    scalar sums)."""
    code = lib.qgemm_i8_dots()
    return next((name for name, c in INT8_DOTS.items() if c == code), None)


def use_int8_dots(lib: ctypes.CDLL, dots: str) -> str | None:
    """Make ``lib``'s 8-bit products use ``dots`` (``auto``: the widest VNNI available,
    else maddubs) for every caller in this process; returns the kind in use. A kind this
    build or CPU lacks is a ValueError naming what there is. Every kind gives the same
    sums."""
    have = int8_dots_available(lib)
    if dots == "auto":
        if not have:
            return None
        dots = have[-1]  # INT8_DOTS' order: the widest last
    if dots not in INT8_DOTS:
        raise ValueError(f"int8 dots {dots!r}: expected auto, {', '.join(INT8_DOTS)}")
    if dots not in have or lib.qgemm_i8_use_dots(INT8_DOTS[dots]) != 0:
        raise ValueError(f"int8 dots {dots!r} are not available on this {isa(lib)} build and "
                         f"CPU (available: {', '.join(have) or 'none'})")
    return dots


def load(settings: KernelSettings | None = None) -> ctypes.CDLL | None:
    """The kernel library for ``settings`` (its build level, compiler and kernel folder),
    built if needed, once per process; ``None`` (reason logged once) if unavailable.

    A compiler too old for the chosen level's ``-march`` falls back to the next lower
    level (and says so)."""
    settings = settings or KernelSettings()
    level = engine_level(settings.cpu_isa)  # a bad PAGEDSERVE_CPU_ISA is the user's error
    key = (level, settings.kernel_dir, settings.cc)
    with _lock:
        if key in _libs:
            return _libs[key]
        lib, errors = None, []
        for lv in reversed(LEVELS[: LEVELS.index(level) + 1]):
            try:
                lib = build_library(lv, settings)
                break
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                errors.append(f"{lv}: {exc}")
                if _compiler(settings.cc) is None:
                    break
        if lib is not None and errors:
            log.warning("native CPU kernels built at a lower level: %s", "; ".join(errors))
        if lib is None:
            _errors[key] = _errors[None] = "; ".join(errors)
            log.warning("native CPU kernels unavailable, using torch ops: %s", _errors[key])
        _libs[key] = lib
        return lib


def unavailable_reason(settings: KernelSettings | None = None) -> str | None:
    """Why :func:`load` returned ``None`` for ``settings`` (without: its latest failure),
    or ``None`` if it has not failed."""
    if settings is None:
        return _errors.get(None)
    return _errors.get((engine_level(settings.cpu_isa), settings.kernel_dir, settings.cc))


def kv_layout(cache: torch.Tensor) -> int | None:
    """The layout code of a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache:
    ``KV_ROWS_FIRST`` when it is contiguous, ``KV_HEADS_FIRST`` when it is a ``transpose(1,
    2)`` view of a contiguous ``[num_blocks, num_kv_heads, block_size, head_dim]`` tensor
    (each KV head's rows of a block one run); None for any other strides."""
    if cache.dim() != 4:
        return None
    if cache.is_contiguous():
        return abi.KV_ROWS_FIRST
    if cache.transpose(1, 2).is_contiguous():
        return abi.KV_HEADS_FIRST
    return None


def _kv_rows(
    key: torch.Tensor | None, value: torch.Tensor | None, slots: torch.Tensor | None,
    k_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``key``/``value`` in the cache dtype or float32 (the kernel rounds float32 rows
    into a 16-bit cache, and quantizes them into an int8 one, which takes float32 only)
    with dense heads and one row stride for both (views of a fused QKV output qualify as
    they are), and int64 ``slots``; None when there is nothing to write."""
    if slots is None:
        return None
    if key is None or value is None:
        raise ValueError("slot_mapping needs key and value")
    heads, cache_width = k_cache.shape[2:]
    width = (heads, cache_width - (KV_INT8_SCALE_BYTES if k_cache.dtype == torch.int8 else 0))
    if key.shape[1:] != width or value.shape != key.shape or slots.shape != key.shape[:1]:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slots.shape)} do not fit the cache rows {width}")

    def dense(t: torch.Tensor) -> bool:
        return t.dtype == key.dtype and t.stride(2) == 1 and t.stride(1) == width[1]

    sources = (torch.float32,) if k_cache.dtype == torch.int8 else (k_cache.dtype, torch.float32)
    if not (key.dtype in sources and dense(key) and dense(value)
            and key.stride(0) == value.stride(0)):  # fmt: skip
        key, value = (t.to(sources[0]).contiguous() for t in (key, value))
    return key, value, slots.to(torch.int64).contiguous()


_C_INT_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def attention_options(window: int, softcap: float) -> tuple[int, float]:
    """``(window, softcap)`` checked for the kernel: ``window`` an integer >= 0 (one
    longer than any context is the same as none: past the largest C int it is passed as
    that), ``softcap`` a finite float32 number >= 0; anything else is a ValueError naming
    the argument."""
    if isinstance(window, bool):
        raise ValueError(f"window must be an integer >= 0, got {window!r}")
    try:
        w = operator.index(window)
    except TypeError:
        raise ValueError(f"window must be an integer >= 0, got {window!r}") from None
    if w < 0:
        raise ValueError(f"window must be >= 0 (0: no sliding window), got {w}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0 or cap > _FLOAT32_MAX:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no soft cap), got {cap}")
    return min(w, _C_INT_MAX), cap


def paged_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a step's query tokens, read in place from the paged cache
    (see the C source). This step's K/V are either already in the cache or given as
    ``key``/``value`` ``[N, Hkv, D]`` (rows may be strided) with ``slot_mapping`` ``[N]``
    (-1: not written): they are written first, in the same call.

    query ``[T, Hq, D]`` (rows may be strided); caches ``[num_blocks, block_size, Hkv,
    D]`` in float32, bfloat16 or float16, or ``[..., D + 4]`` int8 (each row its codes
    and its float32 scale, :func:`pagedserve.kernels.torch_ref.quantize_kv_rows`), in
    either layout :func:`kv_layout` names;
    block_tables ``[B, M]``, seq_lens ``[B]`` and
    query_start_loc ``[B + 1]`` int32 on the CPU: request ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, the last positions of its context of
    ``seq_lens[i]`` tokens. Without ``query_start_loc`` every request has one token
    (decode, ``T == B``). ``max_seq_len`` is at least every ``seq_lens`` entry. Returns
    ``[T, Hq, D]`` in the query dtype (computed in float32), written into ``out`` when
    given.

    ``window`` > 0: a sliding window, each query attends to its last ``window`` positions
    (itself included) only; ``softcap`` > 0: each scaled score ``s`` becomes ``softcap *
    tanh(s / softcap)`` before the softmax (Gemma 2). 0 (the default) leaves either off,
    as :mod:`pagedserve.kernels.torch_ref` computes them.
    """
    window, softcap = attention_options(window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if cache_dim != kv_row_width(head_dim, k_cache.dtype) or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not "
                         f"match query {tuple(query.shape)}")  # fmt: skip
    if k_cache.dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported KV cache dtype {k_cache.dtype}")
    layout = kv_layout(k_cache)
    if layout is None or kv_layout(v_cache) != layout:
        raise ValueError("KV cache strides fit neither layout: the caches must be contiguous, "
                         "or both transpose(1, 2) views of contiguous [num_blocks, "
                         "num_kv_heads, block_size, head_dim] tensors")
    if query_start_loc is None:
        if num_seqs != num_tokens:
            raise ValueError(f"{num_tokens} query rows for {num_seqs} decode requests")
        qsl = None
    else:
        qsl = query_start_loc.to(torch.int32).contiguous()
        if qsl.shape != (num_seqs + 1,) or int(qsl[-1]) > num_tokens or int(qsl[0]) < 0:
            raise ValueError(f"query_start_loc {tuple(qsl.shape)} does not fit {num_seqs} "
                             f"requests and {num_tokens} query rows")  # fmt: skip
    # Rows may be strided (views of a fused QKV output); heads and dims must not be.
    if query.dtype == torch.float32 and query.stride(2) == 1 and query.stride(1) == head_dim:
        q = query
    else:
        q = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rows = _kv_rows(key, value, slot_mapping, k_cache)
    write = (None, None, 0, 0, None, 0) if rows is None else (
        rows[0].data_ptr(), rows[1].data_ptr(), DTYPE_CODES[rows[0].dtype], rows[0].stride(0),
        rows[2].data_ptr(), rows[0].shape[0])
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    result = out if direct else torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    status = lib.paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPE_CODES[k_cache.dtype], layout,
        tables.data_ptr(), lens.data_ptr(), None if qsl is None else qsl.data_ptr(), q.stride(0),
        result.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
        tables.shape[1], max_seq_len, scale, window, softcap, *write, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"paged_attention: {abi.ATTENTION_ERRORS.get(status, status)}")
    if out is None:
        return result.to(query.dtype)
    if not direct:
        out.copy_(result)
    return out

