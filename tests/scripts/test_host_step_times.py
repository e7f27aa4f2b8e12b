"""``scripts/host_step_times.py`` runs and reports the three timings it promises, and the
collector's passes with ``--gc``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_step_times_reports_step_execute_and_prepare() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_step_times.py"),
                           "--batch", "3", "--new-tokens", "40", "--gc", "--freeze"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.fullmatch(r"batch 3: step (\d+) us, execute (\d+) us, prepare (\d+) us",
                     proc.stdout.strip().splitlines()[-4])  # fmt: skip
    assert m is not None, proc.stdout
    step, execute, prepare = map(int, m.groups())
    assert 0 < prepare <= execute <= step  # each is timed inside the one before
    gc_lines = proc.stdout.strip().splitlines()[-3:]
    for gen, line in enumerate(gc_lines):
        assert re.fullmatch(rf"gc generation {gen}: \d+ passes(, median [\d.]+ ms, max [\d.]+ ms)?",
                            line), line  # fmt: skip
