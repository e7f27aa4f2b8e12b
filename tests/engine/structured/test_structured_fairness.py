"""The heaviest structured request a client may send (``n=16``, a string of up to 100k
characters) leaves a plain request beside it its pace: the group's masks cost little per
step (under ``auto`` such a schema goes to llguidance, whose bounded strings fill their
masks fast), and the plain request finishes in its own number of steps, before the group.
Offline, a schema the backend would not enforce is an exception, not an output."""

from __future__ import annotations

import time

import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsError, StructuredOutputsParams
from pagedserve.engine.structured.backend import choose_backend
from pagedserve.engine.structured.bitmask import TokenBitmask

HEAVY = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 100000}},
         "required": ["s"]}
FILL_CPU_LIMIT_S = 0.25
"""Thread CPU time one step's mask rows (16 at most) of the heavy group may take (the
mended xgrammar grammar took about 0.15 s a row, 2.4 s a step; llguidance takes under 1 ms
a step)."""


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_path, make_tiny):
    path = make_tiny("llama", tmp_path_factory.mktemp("tiny-fair"), default_model_path)
    return LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.05,
               max_num_batched_tokens=256)


def test_bounded_strings_go_to_llguidance_under_auto():
    assert choose_backend("auto", StructuredOutputsParams(json=HEAVY)) == "llguidance"
    assert choose_backend("xgrammar", StructuredOutputsParams(json=HEAVY)) == "xgrammar"


def test_plain_request_keeps_its_pace_beside_a_heavy_structured_group(llm, monkeypatch):
    eng, tok = llm.engine, llm.get_tokenizer()
    heavy = StructuredOutputsParams(json=HEAVY)
    eng.structured.submit(heavy).result(timeout=120)
    fills: list[tuple[int, float]] = []
    fill = TokenBitmask.fill

    def timed(self, matchers, vocab_size, pin_memory=False):
        t0 = time.thread_time()
        out = fill(self, matchers, vocab_size, pin_memory)
        fills.append((len(matchers), time.thread_time() - t0))
        return out

    monkeypatch.setattr(TokenBitmask, "fill", timed)
    prompt = tok.encode("Write a long story as JSON:")
    eng.add_request("heavy", prompt, SamplingParams(n=16, temperature=1.0, seed=3,
                                                    max_tokens=40, structured_outputs=heavy))
    eng.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True))
    steps = 0
    while steps < 20:
        steps += 1
        if any(o.request_id == "plain" and o.finished for o in eng.step()):
            break
    # The plain request takes one step a token: the group delays it by no step, and it
    # finishes before the group.
    assert steps <= 9, steps
    group = eng.output.groups.get("heavy")
    assert group is not None and not group.finished
    eng.abort_request("heavy")
    while eng.has_unfinished_requests():
        eng.step()
    # Every step the plain request ran filled the group's masks (16 rows, fewer as its
    # strings close), each within the limit.
    assert fills[0][0] == 16 and len(fills) >= steps - 1, fills
    assert max(cpu for _rows, cpu in fills) < FILL_CPU_LIMIT_S, fills


def test_offline_refusals_raise(llm):
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}))
    with pytest.raises(StructuredOutputsError, match="uses 'not' at #/properties/a"):
        llm.generate("hi", sp, use_tqdm=False)
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        grammar='root ::= root "a"'))
    with pytest.raises(ValueError, match="structured_outputs.grammar has no finite derivation"):
        llm.generate("hi", sp, use_tqdm=False)
    assert llm.engine.kv.stats().num_used_blocks == 0
