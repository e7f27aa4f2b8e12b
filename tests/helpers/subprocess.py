"""Running a test module as a script in a fresh interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_RUNNER = ("import runpy, sys; sys.path.append({root!r}); sys.argv = sys.argv[1:]; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")


def run_as_script(path: str | Path, *args: str) -> list[str]:
    """The command that runs ``path`` as ``__main__`` with ``args``, with ``tests`` importable.

    The checkout goes on the path after site-packages, where its folders' bare names
    (``kernels``) cannot shadow installed distributions of those names, and not before it
    as ``python path`` or ``PYTHONPATH`` would put it."""
    return [sys.executable, "-c", _RUNNER.format(root=str(REPO_ROOT)), str(path), *args]
