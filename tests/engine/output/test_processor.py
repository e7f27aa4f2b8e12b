"""The output side ends requests without touching the scheduler: a stop string's request is
returned to the engine loop, which finishes it (vLLM's ``reqs_to_abort`` shape)."""

from __future__ import annotations

import ast
from pathlib import Path

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core.request import Request, RequestGroup, RequestStatus
from pagedserve.engine.core.scheduler_output import SampledToken
from pagedserve.engine.output.detokenizer import IncrementalDetokenizer
from pagedserve.engine.output.processor import OUTPUT_FINAL, OutputProcessor
from pagedserve.engine.output.stop import StopChecker

OUTPUT_DIR = Path(__file__).resolve().parents[3] / "engine" / "output"


def test_output_side_names_no_scheduler() -> None:
    """No module of engine/output imports the scheduler or reaches one through a name."""
    found = {}
    for path in sorted(OUTPUT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            hit = (isinstance(node, ast.ImportFrom) and node.module
                   and node.module.endswith("core.scheduler")
                   or isinstance(node, ast.Attribute) and "scheduler" in node.attr.lower()
                   or isinstance(node, ast.Name) and "scheduler" in node.id.lower()
                   or isinstance(node, ast.arg) and "scheduler" in node.arg.lower())  # fmt: skip
            if hit:
                found.setdefault(path.name, []).append(node.lineno)
    assert found == {}


def _request(tokenizer, text_prompt: str, params: SamplingParams) -> Request:
    ids = tokenizer.encode(text_prompt)
    group = RequestGroup("r", text_prompt, ids, params, 0.0)
    req = Request("r", group, 0, params, ids, max_tokens=params.max_tokens)
    req.detok = IncrementalDetokenizer(tokenizer, ids)
    req.stop_checker = StopChecker(params.stop)
    group.members.append(req)
    return req


def test_a_stop_string_is_returned_to_the_loop_with_its_cut(default_tokenizer) -> None:
    params = SamplingParams(max_tokens=16, stop=[" world"], temperature=0.0)
    req = _request(default_tokenizer, "Say:", params)
    proc = OutputProcessor(lambda t: default_tokenizer.decode([t]), default_tokenizer)
    proc.add(req.group, OUTPUT_FINAL)
    out = default_tokenizer.encode(" hello world and more")
    req.all_token_ids += out  # as the scheduler appends a step's tokens (accepted drafts)
    before = list(req.all_token_ids)
    sampled = [SampledToken(req, t, None, False, i + 1) for i, t in enumerate(out)]
    groups = proc.process(sampled)
    assert groups == [req.group]
    # The processor changed neither the request's tokens nor its status ...
    assert req.all_token_ids == before and req.status is RequestStatus.WAITING
    (ended,) = proc.take_ended()
    # ... it says which request ends, why, and how many output tokens stay.
    assert ended.request is req and ended.status is RequestStatus.FINISHED_STOPPED
    assert default_tokenizer.decode(out[:ended.keep]).endswith(" world")
    assert ended.keep < len(out) and req.stop_reason == " world"
    assert req.output_text == " hello" and proc.take_ended() == []


def test_engine_loop_finishes_what_the_output_side_ended(default_model_path) -> None:
    llm = LLM(str(default_model_path), dtype="float32", max_model_len=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    words = full.outputs[0].text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    (cut,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    o = cut.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert full.outputs[0].text.startswith(o.text + stop)
    n = len(o.token_ids)
    assert o.token_ids == full.outputs[0].token_ids[:n] and n < 24
    assert llm.engine.scheduler.requests == {}  # finished: its blocks back in the pool
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
