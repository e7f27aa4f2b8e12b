"""Tensor-parallel ranks in tests: replacing the program a rank runs, and what an engine
may leave behind in this process (child processes, shared-memory segments)."""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def rank_command(monkeypatch, code: str) -> None:
    """Start ranks 1..N-1 as ``python -c code`` (their usual arguments in ``sys.argv``,
    the engine's configuration on their stdin)."""
    from pagedserve.engine.parallel import launch

    real = launch.subprocess.Popen

    def popen(args, **kwargs):  # every Popen of the process: only the ranks' change
        if list(args[1:3]) == ["-m", "pagedserve.engine.worker.rank"]:
            args = [args[0], "-c", code, *args[3:]]
        return real(args, **kwargs)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)


def child_pids() -> set[int]:
    """This process's children (zombies included: a child nobody reaped is left behind)."""
    me, found = os.getpid(), set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:
            found.add(int(d.name))
    return found


def shm_entries() -> set[str]:
    """The names in /dev/shm but those of other processes (a test run beside this one):
    multiprocessing's semaphores and other engines' tensor-parallel segments."""
    if not SHM_DIR.is_dir():
        return set()
    other_tp = re.compile(rf"pagedserve-tp-(?!{os.getpid()}-)\d+-")
    return {n for n in os.listdir(SHM_DIR)
            if not n.startswith("sem.mp-") and not other_tp.match(n)}  # fmt: skip
