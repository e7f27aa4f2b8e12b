"""``scripts/gpu_check.sh`` and ``scripts/gpu_check.py`` on a CPU-only machine.

The GPU check runs only where a GPU is lent, rarely; these tests run its argument
parsing and every part's set-up (up to the first CUDA call) here, and the bench part
end to end on the CPU, so that a refactor elsewhere cannot break it unseen.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.models import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load_gpu_check()


def _dry_run(parts: str, budget: int = 450, timeout: int = 240,
             repo: Path = ROOT) -> subprocess.CompletedProcess:  # fmt: skip
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_PARTS=parts,
               GPU_CHECK_BUDGET_S=str(budget))  # fmt: skip
    env.pop("OUT", None)
    return subprocess.run(["bash", str(repo / SCRIPT.relative_to(ROOT)), "--dry-run"],
                          cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _status(stdout: str) -> dict[str, str]:
    """Part name -> its status line, from the printed summary."""
    block = stdout.split("-- parts --\n", 1)[1].split("-- results --", 1)[0]
    return {line.split()[0]: line for line in block.splitlines() if line.strip()}


def test_dry_run_sets_up_every_python_part_and_stops_before_cuda() -> None:
    proc = _dry_run("env gate bench-model bench bench-eager bandwidth hf-eq")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    status = _status(proc.stdout)
    assert list(status) == ["env", "gate", "bench-model", "bench", "bench-eager", "bandwidth",
                            "hf-eq"]  # fmt: skip
    for line in status.values():
        assert " DRY-RUN " in line and "stopped before the first CUDA call" in line, line
    # The bench part parsed the script's own bench flags with the bench's parser.
    assert "dtype='bfloat16', max_num_seqs=256, enforce_eager=False" in status["bench"]
    assert "enforce_eager=True" in status["bench-eager"]
    # The gate wrote its bf16 model and built its workloads before stopping.
    assert "engines on ['3K+ prompts', 'batch 17', 'batch 255', 'batch 3']" in status["gate"]
    assert "overall: PASS (dry run)" in proc.stdout


def test_part_limits_must_fit_the_budget() -> None:
    proc = _dry_run("env", budget=10)
    assert proc.returncode == 1
    assert "part limits sum to 15s: OVER the 10s budget" in proc.stdout
    assert "overall: FAIL (dry run)" in proc.stdout


def test_default_part_limits_fit_the_default_budget() -> None:
    text = SCRIPT.read_text()
    table = text.split("declare -A LIMIT=(", 1)[1].split(")\n", 1)[0]
    limits = {k: int(v) for k, v in
              (item.strip("[").split("]=") for item in table.split())}  # fmt: skip
    parts = text.split('ALL_PARTS="', 1)[1].split('"', 1)[0].split()
    assert sorted(parts) == sorted(limits)
    assert sum(limits.values()) <= int(text.split("GPU_CHECK_BUDGET_S:-", 1)[1].split("}")[0])


def test_bench_rejects_a_flag_the_bench_does_not_have() -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--dry-run", "bench", "--model", "m", "--no-such-flag", "1"])
    assert exc.value.code == 2


def test_bench_runs_end_to_end_on_the_cpu(tmp_path) -> None:
    """The whole bench part (the throughput bench, its report's keys, the summary line)
    on a tiny model on the CPU."""
    model = write_tiny_model(tmp_path / "tiny")
    summary = tmp_path / "summary.txt"
    rc = gpu_check.main([
        "--summary", str(summary), "bench", "--enforce-eager", "--model", str(model),
        "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-gb", "0.02",
        "--max-model-len", "256", "--num-requests", "2", "--input-len-min", "8",
        "--input-len-max", "12", "--output-len-min", "3", "--output-len-max", "4",
        "--no-warmup", "--no-floor",
    ])  # fmt: skip
    assert rc == 0
    lines = summary.read_text().splitlines()
    assert lines[0].startswith("bench eager : ") and " out tok/s " in lines[0], lines
    assert "KV blocks" in lines[0]


_KERNEL_CASE = """
import sys
import torch
sys.path.insert(0, {scripts!r})
sys.path.append({root!r})
import gpu_gate
print("err", gpu_gate._kernel_case(64, 4, gpu_gate.KERNEL_CASE_BLOCKS, False, torch.float32,
                                   dev="cpu"))
print("top", gpu_gate._kernel_case(64, 16, 100, True, torch.float32, dev="cpu"))
try:
    gpu_gate._kernel_case(64, 4, 72, False, torch.float32, dev="cpu")
except ValueError as exc:
    print("refused", exc)
"""


def test_gate_kernel_case_runs_in_the_interpreter_and_fits_its_cache() -> None:
    # The gate's kernel case on the CPU under the Triton interpreter: its requests' blocks
    # fit the cache it allocates (an index past the cache is a device assert on a GPU), and
    # the kernels match the reference in float32.
    code = _KERNEL_CASE.format(root=str(ROOT), scripts=str(ROOT / "scripts"))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert float(lines["err"]) < 1e-4
    assert float(lines["top"]) < 1e-4
    assert lines["refused"] == "num_blocks=72: the case needs at least 73"


def _header_tree(repo: Path) -> str:
    proc = _dry_run("env", timeout=120, repo=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout.split("files: tree ", 1)[1].split()[0]


def test_summary_names_the_tree_of_the_files_it_ran(tmp_path) -> None:
    # A clone of this repository's last commit: the header's tree is that commit's tree;
    # with a file changed and not committed it differs, and a commit of the change makes
    # them equal again (what tells a device run's files apart from its stale .git).
    repo = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True, timeout=120)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                              text=True, timeout=60).stdout.strip()  # fmt: skip

    assert git("log", "-1", "--format=%T").startswith(_header_tree(repo))
    readme = repo / "README.md"
    readme.write_text(readme.read_text() + "\nchanged\n")
    changed = _header_tree(repo)
    assert not git("log", "-1", "--format=%T").startswith(changed)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "change")
    assert git("log", "-1", "--format=%T").startswith(changed)
