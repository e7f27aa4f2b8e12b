"""``pagedserve bench score``: the three runs, their prompt logprobs checked, the report."""

from __future__ import annotations

import json

from pagedserve.server import cli


def test_score_bench_runs_and_reports(tmp_path, capsys, default_model_path) -> None:
    out = tmp_path / "score.json"
    args = cli.build_parser().parse_args([
        "bench", "score", "--num-requests", "3", "--input-len", "40", "--top-k", "2",
        "--repeats", "1", "--kv-cache-memory-gb", "0.05", "--save-result", str(out)])
    report = args._bench_main(args)
    assert report["prompt_tokens"] == 120
    assert list(report["runs"]) == ["plain prefill", "prompt_logprobs=0", "prompt_logprobs=2",
                                    "embed (last token)", "embed (mean)"]
    assert report["runs"]["plain prefill"]["time_over_plain"] == 1.0
    assert all(r["prompt_tok_per_s"] > 0 and len(r["seconds"]) == 1
               for r in report["runs"].values())  # fmt: skip
    assert json.loads(out.read_text())["runs"].keys() == report["runs"].keys()
    text = capsys.readouterr().out
    assert "== pagedserve bench score ==" in text and "prompt tok/s" in text
