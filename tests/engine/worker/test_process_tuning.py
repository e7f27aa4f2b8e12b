"""Process-wide settings: none on import; the OpenMP spin set by the command line before
torch is loaded; malloc tuned and everything reported when an engine starts."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

import pytest

from pagedserve.engine import envs
from pagedserve.engine.worker import process_tuning

OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_malloc_tuning_applies_on_glibc_and_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.delenv(envs.MALLOC_TUNING.name, raising=False)
    assert process_tuning.tune_malloc() is True
    monkeypatch.setenv(envs.MALLOC_TUNING.name, "0")
    assert process_tuning.tune_malloc() is False


def test_free_memory_goes_back_to_the_kernel_on_glibc_only(monkeypatch) -> None:
    # A freed 64 MiB block below the tuned mmap threshold stays in the heap until trimmed.
    if platform.libc_ver()[0] == "glibc":
        out = _python(
            "import ctypes, re\n"
            "from pagedserve.engine.worker import process_tuning\n"
            "process_tuning.tune_malloc()\n"
            "libc = ctypes.CDLL('libc.so.6'); libc.malloc.restype = ctypes.c_void_p\n"
            "rss = lambda: int(re.search(r'RssAnon:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
            "ps = [libc.malloc(1 << 20) for _ in range(64)]\n"
            "[ctypes.memset(p, 1, 1 << 20) for p in ps]\n"
            "[libc.free(ctypes.c_void_p(p)) for p in ps]\n"
            "kept = rss(); ok = process_tuning.return_free_memory()\n"
            "print(ok, kept - rss() > 32 * 1024)")
        assert out == "True True"
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert process_tuning.return_free_memory() is False


def test_importing_engine_changes_nothing() -> None:
    """``import pagedserve`` sets no variable and loads no torch (so no allocator or OpenMP
    setting); importing the engine's classes sets no variable either."""
    code = ("import os, sys\n"
            "before = dict(os.environ)\n"
            "import pagedserve, pagedserve.engine.envs, pagedserve.engine.worker.process_tuning\n"
            "print(dict(os.environ) == before, 'torch' in sys.modules)\n"
            "from pagedserve import LLM, SamplingParams\n"
            "print(dict(os.environ) == before, 'torch' in sys.modules)\n")  # fmt: skip
    assert _python(code).split() == ["True", "False", "True", "True"]


def _cli_env(**env: str) -> tuple[str, str]:
    """GOMP_SPINCOUNT and whether torch was loaded when ``pagedserve`` builds its parser
    (which imports the subcommands, and torch with them)."""
    code = ("import os, sys\n"
            "import pagedserve.server.cli as cli\n"
            "def probe():\n"
            "    print(os.environ.get('GOMP_SPINCOUNT', '-'), 'torch' in sys.modules)\n"
            "    raise SystemExit(0)\n"
            "cli.build_parser = probe\n"
            "cli.main([])\n")  # fmt: skip
    spin, torch_loaded = _python(code, **env).split()
    return spin, torch_loaded


def test_the_command_line_sets_a_short_spin_before_torch_but_respects_the_user() -> None:
    assert _cli_env() == (process_tuning.SPIN_COUNT, "False")
    assert _cli_env(OMP_WAIT_POLICY="PASSIVE") == ("-", "False")
    assert _cli_env(GOMP_SPINCOUNT="10000") == ("10000", "False")


def test_engine_start_reports_what_is_in_effect(monkeypatch, caplog) -> None:
    for name in OMP_VARS:
        monkeypatch.delenv(name, raising=False)
    # torch is loaded in this process: too late to set the spin, and said so.
    assert process_tuning.set_omp_spin() is False and envs.gomp_spincount() is None
    monkeypatch.setenv(envs.HUGEPAGES.name, "0")
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.worker.process_tuning"):
        tuning = process_tuning.apply()
    assert "libgomp's default spin (torch was loaded before" in tuning.omp_spin
    assert tuning.hugepages is False and "huge pages off" in caplog.text
    assert tuning.summary() in caplog.text
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert process_tuning.omp_spin() == "OMP_WAIT_POLICY=PASSIVE (from the environment)"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert process_tuning.omp_spin() == "GOMP_SPINCOUNT=5 (from the environment)"


def test_cycles_made_after_the_startup_freeze_are_collected_promptly() -> None:
    """A finished request is a cycle (it and its group refer to each other) that lives
    long enough to reach the oldest generation. After the startup heap is frozen, the
    collector's full passes must still come: a cycle in the oldest generation, made after
    600k frozen objects, is gone before 120k more long-lived objects have been made (a
    full pass comes about every 70k; without the reset the first waits for 150k)."""
    code = """
import gc, weakref
from pagedserve.engine.worker.process_tuning import freeze_startup_heap
startup = [[i] for i in range(600_000)]
freeze_startup_heap()
class Req:
    pass
a, b = Req(), Req()
a.other, b.other = b, a
dead = weakref.ref(a)
gc.collect(1)  # the two survive the younger passes: now in the oldest generation
del a, b
kept = []
while dead() is not None and len(kept) < 120_000:
    kept.append([len(kept)])
print("collected" if dead() is None else f"alive after {len(kept)} long-lived objects")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120).stdout.strip()
    assert out == "collected"
