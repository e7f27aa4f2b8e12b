"""Where pagedserve keeps what it builds and converts: ``$PAGEDSERVE_CACHE``, else
``~/.cache/pagedserve`` (converted models under ``models/``, native kernels under
``kernels/``). Here, not in ``engine``, because ``kernels`` must not import ``engine``."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "PAGEDSERVE_CACHE"
"""Environment variable overriding the pagedserve cache root."""


def cache_root() -> Path:
    """The pagedserve cache root (``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``)."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedserve"
