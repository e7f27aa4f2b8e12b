"""``pagedserve bench priority``: both policies run the same workload; under priority the
interactive requests get their first tokens in fewer engine steps, at the cost of
preempting batch requests; the report."""

from __future__ import annotations

import json

from pagedserve.server import cli


def test_priority_bench_runs_and_reports(tmp_path, capsys, default_model_path) -> None:
    out = tmp_path / "priority.json"
    args = cli.build_parser().parse_args([
        "bench", "priority", "--batch-requests", "4", "--batch-input-len", "24",
        "--batch-output-len", "24", "--interactive-requests", "2",
        "--interactive-input-len", "8", "--interactive-output-len", "3", "--delay-steps",
        "3", "--max-num-seqs", "2", "--kv-cache-memory-gb", "0.05", "--save-result",
        str(out)])
    report = args._bench_main(args)
    fcfs, prio = report["policies"]["fcfs"], report["policies"]["priority"]
    # Under fcfs the interactive requests wait for the batch's seats; under priority
    # they take two seats at once (preempting two batch requests).
    assert fcfs["preemptions"] == 0 and prio["preemptions"] == 2
    assert prio["interactive_ttft_steps"] == [1, 1]
    assert min(fcfs["interactive_ttft_steps"]) > 10
    assert report["interactive_ttft_fcfs_over_priority"] > 0
    assert json.loads(out.read_text())["policies"].keys() == {"fcfs", "priority"}
    text = capsys.readouterr().out
    assert "== pagedserve bench priority ==" in text and "interactive TTFT" in text
