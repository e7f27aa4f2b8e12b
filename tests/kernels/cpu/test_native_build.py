"""The native CPU kernels' build: one cached library per level, the fall-backs when it
cannot be built, the levels a CPU's flags allow, and the one declaration of its ABI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.engine.worker.kernel_settings import kernel_settings
from pagedserve.kernels import get_attention_backend
from pagedserve.kernels.cpu import native as cpu_native


@pytest.fixture
def lib(native_lib):
    """Every build level this CPU runs (conftest's ``native_lib``)."""
    return native_lib


def _run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PAGEDSERVE_CACHE": str(cache), **env}
    full.pop("PAGEDSERVE_ATTENTION_BACKEND", None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, check=False)  # fmt: skip


def test_concurrent_first_builds_share_one_library(tmp_path: Path) -> None:
    """Processes building at once all load a kernel; one cached library remains."""
    code = ("from pagedserve.engine.worker.kernel_settings import kernel_settings\n"
            "from pagedserve.kernels.cpu import native as cpu_native\n"
            "settings = kernel_settings()  # $PAGEDSERVE_CACHE/kernels\n"
            "assert cpu_native.load(settings) is not None, cpu_native.unavailable_reason()\n")  # fmt: skip
    full = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=full) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", built


def test_without_a_compiler_auto_falls_back_to_torch(tmp_path: Path) -> None:
    code = (
        "import logging, pytest\n"
        "logging.basicConfig()\n"
        "from pagedserve.engine.worker.kernel_settings import kernel_settings\n"
        "from pagedserve.kernels import get_attention_backend\n"
        "assert get_attention_backend('auto', 'cpu', kernel_settings()).name == 'torch'\n"
        "with pytest.raises(RuntimeError, match='no C compiler'):\n"
        "    get_attention_backend('cpu', 'cpu', kernel_settings())\n"
    )
    proc = _run(code, tmp_path, CC="/nonexistent/cc", PATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "native CPU kernels unavailable" in proc.stderr
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def test_failed_build_falls_back_and_leaves_no_partial_file(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    cc = fake / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\n"
                  "echo 'fatal: broken' >&2\nexit 3\n")  # fmt: skip
    cc.chmod(0o755)
    code = ("from pagedserve.engine.worker.kernel_settings import kernel_settings\n"
            "from pagedserve.kernels import get_attention_backend\n"
            "from pagedserve.kernels.cpu import native as cpu_native\n"
            "assert get_attention_backend('auto', 'cpu', kernel_settings()).name == 'torch'\n"
            "print(cpu_native.unavailable_reason(kernel_settings()))\n")  # fmt: skip
    proc = _run(code, tmp_path, CC=str(cc))
    assert proc.returncode == 0, proc.stderr
    assert "fatal: broken" in proc.stdout
    assert list((tmp_path / "kernels").iterdir()) == []


def test_explicit_backend_env_var_selects_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PAGEDSERVE_ATTENTION_BACKEND`` reaches the registry through the engine's settings."""
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    assert get_attention_backend("auto", "cpu", kernel_settings()).name == "torch"
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "cpu")
    assert get_attention_backend("auto", "cpu", kernel_settings()).name == "cpu"


def test_attention_code_prefetches_the_next_block(lib) -> None:
    """The sweeps over a block fetch the next block ahead. A compiler once deleted every
    prefetch of the kernel (it judged the helper free of side effects); outputs stay
    the same without them, so only the built code shows it."""
    if cpu_native.isa(lib) == "portable":
        assert not lib.gemm_f32_available()
        return  # the portable loops rely on the hardware prefetcher
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with gcc) is needed to read the library"
    for fn in ("attend_vec_f32", "attend_vec_bf16"):
        asm = subprocess.run([objdump, "-d", f"--disassemble={fn}", lib._name],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "vfmadd" in asm, f"{fn} not found in {lib._name}"
        assert "prefetcht1" in asm, f"{fn} has no prefetch instruction"
        width = "zmm" if cpu_native.isa(lib) == "avx512" else "ymm"
        assert f"%{width}" in asm and ("%zmm" in asm) == (width == "zmm"), fn


def test_engine_builds_the_best_level_this_cpu_runs(monkeypatch) -> None:
    """The engine's library is the best runnable level; PAGEDSERVE_CPU_ISA picks another
    and a level this CPU cannot run is refused by name."""
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA", raising=False)
    lib = cpu_native.load(kernel_settings())
    assert lib is not None, cpu_native.unavailable_reason()
    assert cpu_native.isa(lib) == cpu_native.runnable_levels()[-1]
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "portable")
    assert cpu_native.engine_level(kernel_settings().cpu_isa) == "portable"
    missing = [lv for lv in cpu_native.LEVELS if lv not in cpu_native.runnable_levels()]
    for level in missing:
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", level)
        with pytest.raises(ValueError, match=f"PAGEDSERVE_CPU_ISA='{level}'"):
            cpu_native.load(kernel_settings())
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_native.engine_level(kernel_settings().cpu_isa)


def test_levels_follow_the_cpu_flags() -> None:
    """Which levels a CPU runs is read from its flags, not from this host."""
    v3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    if cpu_native.is_x86():
        assert cpu_native.runnable_levels(frozenset({"sse2"})) == ("portable",)
        assert cpu_native.runnable_levels(frozenset(v3 - {"fma"})) == ("portable",)
        assert cpu_native.runnable_levels(frozenset(v3)) == ("portable", "avx2")
        assert cpu_native.runnable_levels(frozenset(v4 | {"amx_bf16"})) == cpu_native.LEVELS
        assert "-march=x86-64-v3" in cpu_native.level_cflags("avx2")
    else:
        assert cpu_native.runnable_levels(frozenset(v4)) == ("portable",)
        assert not any(f.startswith("-march") for f in cpu_native.level_cflags("portable"))


def test_the_abi_header_is_the_one_declaration(lib) -> None:
    """Constants and signatures come from ``csrc/abi.h`` only: every prototype there is
    exported by the library, and no source redefines one of its constants."""
    from pagedserve.kernels.cpu import abi

    assert abi.SIGNATURES and all(hasattr(lib, name) for name in abi.SIGNATURES)
    assert list(cpu_native.DTYPE_CODES.values()) == [abi.DTYPE_F32, abi.DTYPE_BF16,
                                                     abi.DTYPE_F16, abi.DTYPE_I8]  # fmt: skip
    assert abi.ATTENTION_ERRORS[abi.CONSTANTS["PA_ERR_HEAD_DIM"]] == "head_dim outside 1..512"
    for source in cpu_native.SOURCES:
        text = source.read_text()
        assert '#include "abi.h"' in text, source.name
        for name in abi.CONSTANTS:
            assert f"#define {name} " not in text and f"{name} =" not in text, (source.name, name)


def test_every_source_file_keys_the_built_library() -> None:
    """The library's cache key reads every file of ``csrc/``: a header missing from the
    list would leave a stale build in the cache after it changes."""
    listed = {p.name for p in (*cpu_native.SOURCES, *cpu_native.HEADERS)}
    assert listed == {p.name for p in cpu_native.CSRC.iterdir() if p.suffix in (".c", ".h")}
