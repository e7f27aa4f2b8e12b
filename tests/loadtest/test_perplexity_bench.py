"""``pagedserve bench perplexity``: chunks scored as llama-perplexity scores them, the
runs' perplexities and agreement, the report."""

from __future__ import annotations

import json
import math

from pagedserve.loadtest.perplexity_bench import TEXT_MODULES, chunk_scores, stdlib_text
from pagedserve.server import cli


def test_the_default_text_is_long_and_fixed() -> None:
    text = stdlib_text()
    assert len(text) > 200_000  # well over 20k tokens in any tokenizer
    assert text == stdlib_text()
    assert "Command-line parsing library" in text  # argparse's own docstring, first
    assert len(TEXT_MODULES) == len(set(TEXT_MODULES))


def test_a_chunk_scores_its_second_half() -> None:
    from pagedserve.engine.core.outputs import Logprob, TokenLogprobs

    entries = [None] + [TokenLogprobs(token_id=i, logprob=-float(i), top=[Logprob(100 + i, -0.5, 1)])
                        for i in range(1, 8)]  # fmt: skip
    logprobs, top = chunk_scores(entries, 4)  # a chunk of 8: tokens 5, 6, 7 scored
    assert logprobs == [-5.0, -6.0, -7.0]
    assert top == [105, 106, 107]


def test_perplexity_bench_runs_and_compares(tmp_path, capsys, default_model_path) -> None:
    """int8 against float activations on the default GGUF, then float against itself:
    the same run twice agrees on every token and has the same perplexity."""
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text()[:40_000], encoding="utf-8")
    out = tmp_path / "ppl.json"
    argv = ["bench", "perplexity", "--quantization", "gguf", "--text", str(text), "--ctx", "128",
            "--max-chunks", "3", "--kv-cache-memory-gb", "0.05", "--save-result", str(out)]
    args = cli.build_parser().parse_args([*argv, "--activations", "int8,float"])
    report = args._bench_main(args)
    assert report["chunks"] == 3 and report["scored"] == 3 * 63
    first, second = report["runs"]
    assert (first["activations"], second["activations"]) == ("int8", "float")
    assert second["quant_activations"] == "float"
    assert all(1.0 < r["ppl"] < 1000.0 and math.isfinite(r["ppl"]) for r in report["runs"])
    # The 8-bit activations' loss is small against the model's own: a few percent here.
    assert abs(second["ppl_vs_first"] - 1.0) < 0.05
    assert second["agreement_vs_first"] > 0.85
    assert json.loads(out.read_text())["runs"][1]["ppl"] == second["ppl"]
    printed = capsys.readouterr().out
    assert "== pagedserve bench perplexity ==" in printed and "top-1 agreement" in printed

    args = cli.build_parser().parse_args([*argv, "--activations", "float,float"])
    again = args._bench_main(args)["runs"]
    assert again[1]["agreement_vs_first"] == 1.0 and again[1]["ppl_vs_first"] == 1.0
    assert again[0]["ppl"] == second["ppl"]
