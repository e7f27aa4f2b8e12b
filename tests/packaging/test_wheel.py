"""A non-editable install (a wheel, as the Docker image installs) carries its data files."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_kernel_sources_and_loadtest_data(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path)],
                   check=True, capture_output=True)  # fmt: skip
    (wheel,) = tmp_path.glob("pagedserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "kernels/cpu/csrc/paged_attention_cpu.c",
        "kernels/cpu/csrc/fused_ops_cpu.c",
        "kernels/cpu/csrc/abi.h",
        "kernels/cpu/csrc/simd.h",
        "loadtest/data/conversations.jsonl",
        "loadtest/run_locust.sh",
    }
    assert expected <= names, sorted(expected - names)
    from kernels.cpu import native as cpu_native

    # Everything the kernel build reads is in the wheel.
    for path in (*cpu_native.SOURCES, *cpu_native.HEADERS):
        assert str(path.relative_to(ROOT)) in names
