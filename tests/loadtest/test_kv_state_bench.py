"""``python -m pagedserve.loadtest.kv_state_bench``: the poller stays light, the snapshot table runs."""

from __future__ import annotations

import subprocess
import sys

from pagedserve.loadtest import kv_state_bench


def test_the_poller_imports_neither_torch_nor_the_engine() -> None:
    # It runs on the cores of the server it measures: its start-up must cost nothing.
    code = ("import sys, pagedserve.loadtest.kv_state_bench; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
            "or m.startswith('pagedserve.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_snapshot_table(capsys) -> None:
    import argparse

    kv_state_bench.snapshot(argparse.Namespace(blocks="256"))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 2 and all(len(r.split("|")) == 9 for r in rows)
