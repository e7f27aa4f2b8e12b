"""``scripts/host_step_times.py`` runs and reports the three timings it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_step_times_reports_step_execute_and_prepare() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_step_times.py"),
                           "--batch", "3", "--new-tokens", "40"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.fullmatch(r"batch 3: step (\d+) us, execute (\d+) us, prepare (\d+) us",
                     proc.stdout.strip().splitlines()[-1])  # fmt: skip
    assert m is not None, proc.stdout
    step, execute, prepare = map(int, m.groups())
    assert 0 < prepare <= execute <= step  # each is timed inside the one before
