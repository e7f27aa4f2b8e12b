"""Greedy outputs at long contexts equal HF transformers token for token: the default
model on prompts of about 2k, 6k and 8k tokens (chunked prefill through the tiled
attention path, then decodes of contexts split among threads), and a tiny Llama with
llama3 RoPE scaling at 16k positions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pagedserve import LLM, SamplingParams
from tests.helpers.hf import hf_greedy

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""

NEW_TOKENS = 8

ADJ = ["quiet", "old", "bright", "narrow", "wooden", "busy", "cold"]
NOUN = ["ferry", "lighthouse", "market", "bridge", "library", "harbour", "orchard",
        "station", "mill", "school", "tower"]  # fmt: skip
VERB = ["opens onto", "looks over", "stands beside", "leads to", "faces"]
PLACE = ["north shore", "old town", "river mouth"]


def document(tokenizer, num_tokens: int) -> list[int]:
    """About ``num_tokens`` tokens of plain sentences about a town (numbered, so no two
    are the same) ending in a question, encoded."""
    lines, i = [], 0
    while True:
        lines.append(f"Note {i}: the {ADJ[i % 7]} {NOUN[i % 11]} {VERB[i % 5]} the "
                     f"{NOUN[(3 * i + 1) % 11]} near the {PLACE[i % 3]}.")  # fmt: skip
        i += 1
        if i % 50 == 0 and len(tokenizer.encode(" ".join(lines))) >= num_tokens:
            break
    ids = tokenizer.encode(" ".join(lines))[:num_tokens]
    return ids + tokenizer.encode(" Question: what does the old ferry face? Answer:")


def greedy_run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_default_model_matches_hf_at_2k_6k_8k(default_model_path, default_tokenizer) -> None:
    prompts = [document(default_tokenizer, n) for n in (2000, 6000, 8150)]
    assert all(len(p) > n for p, n in zip(prompts, (2000, 6000, 8150), strict=True))
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    assert max(map(len, prompts)) + NEW_TOKENS <= llm.engine.settings.max_model_len
    got = greedy_run(llm, prompts)
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
    del llm
    assert got == hf_greedy(default_model_path, prompts, NEW_TOKENS)


def test_tiny_llama3_rope_matches_hf_at_16k(tmp_path, tiny_model_factory,
                                            default_tokenizer) -> None:  # fmt: skip
    path = Path(shutil.copytree(tiny_model_factory("llama"), tmp_path / "tiny"))
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    # llama3 scaling stretches the 256 original positions 8x; serve far past that.
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    cfg["max_position_embeddings"] = 16384 + 64
    cfg_file.write_text(json.dumps(cfg))
    prompts = [document(default_tokenizer, 16384), document(default_tokenizer, 3000)[-700:]]
    llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=False)
    got = greedy_run(llm, prompts)
    assert got == hf_greedy(path, prompts, NEW_TOKENS)
