"""``scripts/as_avx2_host.sh`` shows its command this CPU's /proc/cpuinfo without the
AVX-512 and AMX flags, and nothing else changed."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "as_avx2_host.sh"


def _flags(line: str) -> set[str]:
    return set(line.split(":", 1)[1].split())


def test_the_cpuinfo_it_shows_lacks_only_avx512_and_amx() -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "--print-cpuinfo"], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    real = Path("/proc/cpuinfo").read_text().splitlines()
    shown = proc.stdout.splitlines()
    assert len(shown) == len(real)
    for a, b in zip(real, shown, strict=True):
        if a.startswith(("flags", "Features")):
            assert _flags(b) == {f for f in _flags(a) if not f.startswith(("avx512", "amx"))}
            assert a.split(":", 1)[0] == b.split(":", 1)[0]
        else:
            assert a == b


def test_without_a_command_it_says_how_to_call_it() -> None:
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr
