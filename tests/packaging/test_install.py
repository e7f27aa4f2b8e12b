"""A non-editable install, as the Docker image makes it (``scripts/install.sh``), into a
fresh virtual environment with the newest transformers, run outside the source tree."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import venv
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import native as cpu_native
from tests.helpers.server import ServerProcess

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh venv's python, a folder outside the source tree to run it in)."""
    base = tmp_path_factory.mktemp("install")
    venv.create(base / "venv", with_pip=True)
    python = base / "venv" / "bin" / "python"
    away = base / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The image's first layer: torch (here the CPU build this suite runs on).
    _run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], away, env=env)
    # Beside the image's extras, Triton and the load-test tools, so that every module imports.
    _run(["bash", str(ROOT / "scripts" / "install.sh"), "gguf,structured,triton,bench"], away,
         env={**env, "PYTHON": str(python)})  # fmt: skip
    # The newest transformers, whatever it brings (Hugging Face's `kernels` since 5.25).
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "transformers"], away, env=env)
    return python, away


def _py(installed: tuple[Path, Path], code: str) -> str:
    python, away = installed
    return _run([str(python), "-I", "-c", textwrap.dedent(code)], away).stdout


def test_installs_only_the_pagedserve_name_with_its_data(installed) -> None:
    files = json.loads(_py(installed, """
        import importlib.metadata, json
        print(json.dumps([str(f) for f in importlib.metadata.files("pagedserve")]))
    """))
    tops = {f.split("/")[0] for f in files if not f.startswith("..")}
    assert tops == {"pagedserve", "pagedserve-0.1.0.dist-info"}
    for path in (*cpu_native.SOURCES, *cpu_native.HEADERS):  # what the kernel build reads
        assert "pagedserve/" + str(path.relative_to(ROOT)) in files
    expected = {"pagedserve/loadtest/data/conversations.jsonl", "pagedserve/loadtest/run_locust.sh",
                "pagedserve/server/static/index.html"}  # fmt: skip
    assert expected <= set(files)
    # Every module of the repository's folders is in the wheel.
    ours = {"pagedserve/" + str(f.relative_to(ROOT)) for d in ("engine", "blockmgr", "kernels",
            "server", "loadtest") for f in (ROOT / d).rglob("*.py")}  # fmt: skip
    assert ours - set(files) == set()


def test_every_module_imports_outside_the_source_tree(installed) -> None:
    report = json.loads(_py(installed, """
        import importlib, importlib.metadata, json, pkgutil, sys
        import pagedserve
        failed = {}
        names = [m.name for m in pkgutil.walk_packages(pagedserve.__path__, "pagedserve.")]
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 (a module that exits counts too)
                failed[name] = repr(exc)
        import kernels  # Hugging Face's, if the newest transformers brought it
        print(json.dumps({"failed": failed, "count": len(names),
                          "file": pagedserve.__file__, "transformers":
                          importlib.metadata.version("transformers"),
                          "hub_kernels": getattr(kernels, "__file__", None)}))
    """))
    assert report["failed"] == {}
    assert report["count"] > 150
    assert "site-packages" in report["file"] and not report["file"].startswith(str(ROOT))
    # The newest transformers' own `kernels` is installed beside pagedserve.kernels.
    assert "site-packages/kernels" in report["hub_kernels"]


def test_cli_help_and_offline_generation_match_the_source_tree(installed) -> None:
    python, away = installed
    helped = _run([str(python.parent / "pagedserve"), "serve", "--help"], away).stdout
    assert helped.startswith("usage: pagedserve serve")
    ids = json.loads(_py(installed, f"""
        import json
        from pagedserve import LLM, SamplingParams
        llm = LLM(dtype="float32")
        out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens=8))
        print(json.dumps(list(out[0].outputs[0].token_ids)))
    """).splitlines()[-1])
    here = LLM(dtype="float32").generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    assert ids == list(here[0].outputs[0].token_ids) and len(ids) == 8


def test_installed_server_answers_a_chat_completion(installed) -> None:
    python, away = installed
    with ServerProcess(["--max-model-len", "512"], python=python, cwd=away) as srv:
        client = srv.openai_client()
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Say hello."}])  # fmt: skip
    assert reply.choices[0].message.content and 1 <= reply.usage.completion_tokens <= 8
    assert reply.choices[0].finish_reason in ("stop", "length")
