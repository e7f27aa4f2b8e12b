"""The package tree's rules: who imports whom, who reads the environment, file sizes.

The import graph is built from the source (every import statement: at module level,
inside functions and under ``TYPE_CHECKING`` alike), so a rule broken only by a lazy or
a type-only import still fails.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("blockmgr", "engine", "kernels", "loadtest", "server")
"""The repository's folders that install as ``pagedserve.<folder>``."""
TOP = "pagedserve"


def module_name(path: Path) -> str:
    """``engine/loop/llm.py`` -> ``pagedserve.engine.loop.llm``; ``pagedserve/__init__.py`` -> ``pagedserve``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == TOP else [TOP, *parts])


def path_of(name: str) -> Path:
    """Where module ``name`` (``pagedserve.engine.loop.llm``) lives in the repository, less its suffix."""
    parts = name.split(".")
    assert parts[0] == TOP, name
    return ROOT.joinpath(*parts[1:]) if len(parts) > 1 else ROOT / TOP


def source_files(*packages: str) -> list[Path]:
    found = sorted(f for p in packages or PACKAGES for f in (ROOT / p).rglob("*.py"))
    return found if packages else [*found, ROOT / TOP / "__init__.py"]


def _is_module(name: str) -> bool:
    if name.split(".")[0] != TOP:
        return False
    path = path_of(name)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """First-party modules ``path`` imports (``from pkg import sub`` counts as ``pkg.sub``
    when ``sub`` is a module, else as ``pkg``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                     else node.module for a in node.names]  # fmt: skip
        found.update(n for n in names if n.split(".")[0] == TOP)
    return found


def folder(name: str) -> str:
    """The top-level folder a module is in (``pagedserve.engine.loop.llm`` -> ``engine``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else TOP


def graph(*packages: str) -> dict[str, set[str]]:
    return {module_name(f): imports_of(f) for f in source_files(*packages)}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or with a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


ENV_READERS = {"engine/envs.py", "server/cli.py", "server/serve_cli.py", "loadtest/locustfile.py",
               "kernels/cpu/bench.py"}
"""Where ``os.environ`` may be used: engine/envs.py and the entry points (the kernels'
benchmark, ``python -m pagedserve.kernels.cpu.bench``, sets the OpenMP spin as ``pagedserve`` does:
kernels import nothing from engine)."""
MAX_LINES = 600
"""A file longer than this holds more than one responsibility. Files are split by role, not
to get under a count: this is the backstop, not the target."""
SIZE_CHECKED = ("blockmgr", "engine", "kernels", "server")


def test_kernels_import_nothing_from_engine() -> None:
    bad = {m: sorted(i for i in imps if folder(i) in ("engine", "server", "loadtest"))
           for m, imps in graph("kernels").items()}  # fmt: skip
    assert {m: v for m, v in bad.items() if v} == {}


def test_blockmgr_imports_only_itself() -> None:
    bad = {m: sorted(i for i in imps if folder(i) != "blockmgr")
           for m, imps in graph("blockmgr").items()}  # fmt: skip
    assert {m: v for m, v in bad.items() if v} == {}


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def room(name: str) -> str:
    """The folder a module lives in, as a room of the house: ``engine.core``,
    ``engine.worker``, ... for the engine's subfolders, ``engine`` for the engine's own
    top-level modules, and the top-level folder otherwise (``blockmgr``, ``server``)."""
    parts = name.split(".")[1:]
    if parts[:1] == ["engine"] and len(parts) >= 2 and (ROOT / "engine" / parts[1]).is_dir():
        return f"engine.{parts[1]}"
    return parts[0] if parts else TOP


def folder_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod, imps in graph().items():
        edges.setdefault(room(mod), set()).update(room(i) for i in imps if room(i) != room(mod))
    return edges


def test_folders_form_a_dag() -> None:
    """Folder by folder the imports only go one way (a cycle through two modules of
    different folders is one the module-level check above sees only when it closes)."""
    edges = folder_graph()
    assert {"engine.core", "engine.loop", "engine.output", "engine.worker", "engine.sample",
            "engine.loader"} <= set(edges)  # fmt: skip
    assert cycles(edges) == []


def test_folder_cycle_finder_sees_a_loop_between_folders() -> None:
    mods = {"pagedserve.engine.core.request": {"pagedserve.engine.lora.request"},
            "pagedserve.engine.lora.slots": {"pagedserve.engine.core.request"}}  # fmt: skip
    edges: dict[str, set[str]] = {}
    for mod, imps in mods.items():
        edges.setdefault(room(mod), set()).update(room(i) for i in imps)
    assert cycles(edges) == [["engine.core", "engine.lora"]]


TORCH_FREE = ("engine/core", "engine/output", "engine/kvstore")
"""Folders that must not load torch, directly or through what they import."""


def test_core_and_output_import_no_torch() -> None:
    names = [module_name(f) for d in TORCH_FREE for f in sorted((ROOT / d).rglob("*.py"))]
    static = {n: sorted(i for i in _imported_names(path_of(n).with_suffix(".py")
                                                   if path_of(n).with_suffix(".py").is_file()
                                                   else path_of(n) / "__init__.py")
                        if i.split(".")[0] in ("torch", "numpy", "triton"))
              for n in names}  # fmt: skip
    assert {n: v for n, v in static.items() if v} == {}
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'numpy', 'triton', 'transformers') "
            "if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_cycle_finder_sees_type_only_imports(tmp_path: Path) -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from pagedserve.engine.worker.worker import Worker\n"
                   "def f():\n    from pagedserve.kernels import registry\n"
                   "import engine.scheduler\n")  # fmt: skip
    assert imports_of(src) == {"pagedserve.engine.worker.worker", "pagedserve.kernels.registry"}


def _environ_users(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv",
                                                                  "unsetenv"):  # fmt: skip
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):  # fmt: skip
            return True
    return False


def test_environment_is_read_only_in_envs_and_entry_points() -> None:
    users = {str(f.relative_to(ROOT)) for f in source_files() if _environ_users(f)}
    assert users - ENV_READERS == set()


def test_no_file_over_the_line_limit() -> None:
    long = {str(f.relative_to(ROOT)): n for p in SIZE_CHECKED for f in (ROOT / p).rglob("*")
            if f.suffix in (".py", ".c", ".h")
            and (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES}  # fmt: skip
    assert long == {}


CORE = ("blockmgr/*.py", "engine/core/scheduler.py", "engine/loop/llm_engine.py",
        "engine/output/processor.py", "engine/loop/async_engine.py", "engine/kvstore/*.py")
"""The core: the block manager, the scheduler, the engine loop, the output processor and
the KV block store."""


def test_no_function_over_60_lines_in_the_core() -> None:
    long = []
    for pattern in CORE:
        for path in sorted(ROOT.glob(pattern)):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                    f"({lines} lines)")
    assert not long, long


def test_design_doc_names_existing_files() -> None:
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:blockmgr|engine|kernels|server|loadtest|scripts|tests)/[^`\s]*)`",
                           text))  # fmt: skip
    assert named and {p for p in named if not (ROOT / p).exists()} == set()


def _imported_names(path: Path) -> set[str]:
    """Every module name an import statement of ``path`` names (``from a import b``: both
    ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_test_module_imports_another_and_no_package_imports_the_tests() -> None:
    bad = {}
    for f in (ROOT / "tests").rglob("*.py"):
        parts = (n.split(".") for n in _imported_names(f))
        hits = {".".join(p) for p in parts if (p[0] == "tests" or len(p) == 1) and any(
            q.startswith("test_") or q == "conftest" for q in p)}  # fmt: skip
        if hits:
            bad[str(f.relative_to(ROOT))] = sorted(hits)
    for f in source_files():
        hits = {n for n in _imported_names(f) if n.split(".")[0] == "tests"}
        if hits:
            bad[str(f.relative_to(ROOT))] = sorted(hits)
    assert bad == {}


def test_first_party_imports_name_pagedserve() -> None:
    """The folders install only under ``pagedserve.``: a bare ``import engine`` (or server,
    kernels, ...) works from the source tree alone and fails in an installed wheel."""
    files = [*source_files(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"),
             *(ROOT / "examples").rglob("*.py")]  # fmt: skip
    bare = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and not node.level else [])  # fmt: skip
            hits = [n for n in names if n.split(".")[0] in PACKAGES]
            if hits:
                bare.setdefault(str(f.relative_to(ROOT)), []).extend(hits)
    assert bare == {}


def test_engine_errors_live_in_one_module() -> None:
    """Every exception class of the engine is defined in engine/errors.py."""
    elsewhere = []
    for path in source_files("engine"):
        if path == ROOT / "engine" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception", "Failure",
                                                                "Timeout")) or b.id == "Exception")
                    for b in node.bases):  # fmt: skip
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert elsewhere == []

