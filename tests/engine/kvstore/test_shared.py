"""Two processes on one store directory: no bad reads, the size stays near the bound."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from pagedserve.engine.kvstore import DiskTier
from tests.helpers.kvstore import FILE_BYTES, NBYTES, dir_bytes, fingerprint, key, payload
from tests.helpers.subprocess import run_as_script

HELPER = Path(__file__).resolve().parents[2] / "helpers" / "kvstore.py"
BLOCKS = 40
CAPACITY = BLOCKS * FILE_BYTES


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    procs = [subprocess.Popen(run_as_script(HELPER, "share", str(tmp_path), str(CAPACITY),
                                            str(seed), "400"),
                              stdout=subprocess.PIPE, text=True)
             for seed in (1, 2)]  # fmt: skip
    root = DiskTier(tmp_path, CAPACITY, fingerprint(), NBYTES).root
    largest = 0
    while any(p.poll() is None for p in procs):
        largest = max(largest, dir_bytes(root))
        time.sleep(0.002)
    reports = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for report in reports:
        assert report["bad"] == 0 and report["loaded"] > 100
        disk = report["stats"]["disk"]
        assert disk["enabled"] == 1 and disk["errors"] == 0 and disk["writes"] > 100
        assert sum(disk["skips"].values()) == disk["skips"]["missing"]
    # Each process writes at most an eighth of the capacity between its rescans (its own
    # index never holds more than the capacity) and has at most one file in flight.
    assert largest <= CAPACITY + 2 * (CAPACITY // 8) + 2 * FILE_BYTES, (largest, CAPACITY)
    tier = DiskTier(tmp_path, CAPACITY, fingerprint(), NBYTES)
    assert dir_bytes(root) == tier.stats()["bytes_used"] <= CAPACITY
    for k in [key(i) for i in range(120)]:
        if tier.contains(k):
            assert tier.get(k) == payload(k)
    assert set(tier.stats()["skips"].values()) == {0}
