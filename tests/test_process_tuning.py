"""Process-wide settings made when the engine is imported."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine import process_tuning


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_malloc_tuning_applies_on_glibc_and_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.delenv(process_tuning.ENV_VAR, raising=False)
    assert process_tuning.tune_malloc() is True
    monkeypatch.setenv(process_tuning.ENV_VAR, "0")
    assert process_tuning.tune_malloc() is False


def _env_after_import(**env: str) -> tuple[str, str]:
    code = ("import os, engine; print(os.environ.get('OMP_WAIT_POLICY', '-'), "
            "os.environ.get('GOMP_SPINCOUNT', '-'))")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True)  # fmt: skip
    policy, spin = out.stdout.split()
    return policy, spin


def test_omp_spin_defaults_to_a_short_spin_but_respects_the_user() -> None:
    assert _env_after_import() == ("-", process_tuning.SPIN_COUNT)
    assert _env_after_import(OMP_WAIT_POLICY="PASSIVE") == ("PASSIVE", "-")
    assert _env_after_import(GOMP_SPINCOUNT="10000") == ("-", "10000")
