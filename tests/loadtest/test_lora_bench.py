"""``pagedserve bench lora``: the same workload on the base model and over k adapters,
each run's throughput against the base's, and how many outputs the adapters changed."""

from __future__ import annotations

import json

from pagedserve.server import cli


def test_lora_bench_runs_and_reports(tmp_path, capsys, default_model_path) -> None:
    out = tmp_path / "lora.json"
    args = cli.build_parser().parse_args([
        "bench", "lora", "--num-requests", "4", "--input-len", "16", "--output-len", "12",
        "--num-loras", "0,2", "--lora-rank", "4", "--kv-cache-memory-gb", "0.05",
        "--save-result", str(out)])
    report = args._bench_main(args)
    base, two = report["runs"]["0"], report["runs"]["2"]
    assert base["output_tokens"] == two["output_tokens"] == 4 * 12
    assert base["vs_base"] == 1.0 and two["vs_base"] > 0
    assert base["outputs_unlike_base"] == 0 and two["outputs_unlike_base"] >= 1
    assert json.loads(out.read_text())["runs"].keys() == {"0", "2"}
    text = capsys.readouterr().out
    assert "== pagedserve bench lora ==" in text and "2 adapters:" in text
