"""engine/envs.py: the one reader of environment variables; its table in docs/environment.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.engine import envs

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "environment.md"
NAME = re.compile(r"PAGEDSERVE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)(?![A-Z0-9_])")
"""A variable's full name (``PAGEDSERVE_LOCUST_*``, a family, is not one)."""


def test_environment_page_table_is_generated_from_envs() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert envs.markdown_table() in page
    out = subprocess.run([sys.executable, "-m", "pagedserve.engine.envs"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout  # fmt: skip
    assert out.strip() == envs.markdown_table()


def test_every_pagedserve_variable_mentioned_is_declared_once() -> None:
    declared = [v.name for v in envs.VARIABLES]
    assert len(declared) == len(set(declared))
    files = [ROOT / "README.md", ROOT / "Dockerfile", *ROOT.glob("docs/*.md"),
             *(f for d in ("engine", "blockmgr", "kernels", "server", "loadtest", "scripts")
               for f in (ROOT / d).rglob("*") if f.suffix in (".py", ".sh"))]  # fmt: skip
    mentioned = {m for f in files for m in NAME.findall(f.read_text(encoding="utf-8"))}
    assert mentioned - set(declared) == set()
    page = set(NAME.findall(PAGE.read_text(encoding="utf-8")))
    assert page == set(declared)


@pytest.mark.parametrize("value,expected", [
    (None, "default"), ("", "default"), ("1", True), ("TRUE", True), (" yes ", True),
    ("on", True), ("0", False), ("False", False), ("no", False), ("OFF", False),
    ("maybe", "default"),
])  # fmt: skip
def test_one_on_off_parser(monkeypatch, value, expected) -> None:
    var = envs.PACK_WEIGHTS
    if value is None:
        monkeypatch.delenv(var.name, raising=False)
    else:
        monkeypatch.setenv(var.name, value)
    for default in (True, False):
        assert envs.flag(var, default) is (default if expected == "default" else expected)


def test_accessors_read_the_variables_when_called(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    assert envs.cache_root() == Path.home() / ".cache" / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert envs.cache_root() == tmp_path
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", " Torch ")
    assert envs.attention_backend() == "torch"
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND")
    assert envs.attention_backend() == "auto"
    monkeypatch.setenv("PAGEDSERVE_LOCUST_MAX_TOKENS", "7")
    monkeypatch.setenv("PAGEDSERVE_LOCUST_WAIT_MAX", "3.5")
    assert (envs.locust_max_tokens(), envs.locust_wait_max()) == (7, 3.5)
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "")
    assert envs.api_key() is None
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert envs.hf_hub_offline()
