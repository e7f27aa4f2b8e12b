"""GGUF files of architectures other than the default model's: a Gemma 3 file (written as
llama.cpp's converter writes one, from a tiny random model) serves HF's greedy tokens,
with the settings transformers' GGUF reader leaves at its defaults read from the header,
and with ``quantization="gguf"`` its Q8_0 weights kept as stored; a Llama file of random
Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 blocks (a Q4_K_M file's types) keeps them as stored and serves
the tokens of its float32 expansion; a Qwen2 file of random Q4_0/Q8_0 weights (its own
tensor names and biases, q/k rows not permuted) serves HF's greedy tokens on the same
file; a file of an architecture the engine does not serve is refused from its header,
before conversion."""

from __future__ import annotations

import logging
import shutil
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.loader import convert_gguf_model, default_gguf_path
from pagedserve.engine.loader.default_model import gguf_model_dir
from pagedserve.engine.loader.gguf_header import config_overrides
from tests.helpers.gguf_files import cached_random_gguf, write_gemma3_gguf, write_random_gguf
from tests.helpers.hf import hf_greedy

NEW = 10
PROMPTS = [[(31 * j + 7) % 20000 + 100 for j in range(n)] for n in (6, 45)]


def greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def gemma3(tiny_model_factory):
    return tiny_model_factory("gemma3_6")


def test_gemma3_gguf_equals_hf(gemma3, gemma3_gguf):
    llm = LLM(str(gemma3_gguf), dtype="float32", kv_cache_memory_gb=0.02)
    # The header's RoPE settings, not the reader's defaults: a scaled global RoPE for the
    # full layer, the local base for the sliding ones; Gemma 3's own layer pattern.
    cfg = llm.engine.settings.hf_config
    assert cfg.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert cfg.rope_parameters["full_attention"]["factor"] == 8.0
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert llm.engine.worker.model.spec.windows == (12,) * 5 + (0,)
    assert greedy(llm) == hf_greedy(gemma3, PROMPTS, NEW)


def test_gemma3_q8_0_gguf_kept_quantized_equals_hf_on_the_file(gemma3, tmp_path):
    path = write_gemma3_gguf(gemma3, tmp_path / "gemma3-q8_0.gguf", default_gguf_path(),
                             quantized="Q8_0")  # fmt: skip
    want = hf_greedy(convert_gguf_model(path), PROMPTS, NEW)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02, quantization="gguf", quantized_activations="float")
    layer = llm.engine.worker.model.layers[5]
    assert layer.qkv_proj.weight.fmt == "q8_0" and layer.down_proj.weight.fmt == "q8_0"
    assert greedy(llm) == want


# Every kept block format; fused parts of one type, and of two (a Q4_K_M file's Q6_K
# attn_v beside Q4_K attn_q/attn_k: each part kept in its own); in layer 1 a gate/up with
# a Q3_K part (expanded, its Q5_0 part too).
BLOCK_TYPES = {
    "token_embd.weight": "Q6_K",  # the embedding and the tied logits
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q4_K",
    "blk.0.attn_output.weight": "Q5_0", "blk.0.ffn_gate.weight": "Q5_K",
    "blk.0.ffn_up.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q4_K", "blk.1.attn_k.weight": "Q4_K", "blk.1.attn_v.weight": "Q6_K",
    "blk.1.attn_output.weight": "Q5_1", "blk.1.ffn_gate.weight": "Q3_K",
    "blk.1.ffn_up.weight": "Q5_0", "blk.1.ffn_down.weight": "Q5_0",
}


def test_k_quant_gguf_kept_quantized_equals_its_float_expansion(tmp_path, caplog):
    """A Llama file (q/k rows as llama.cpp's converter permutes them: the loader puts the
    kept blocks' rows back with ``select_rows``) whose weights are random valid blocks:
    served from its blocks, the greedy tokens of the same file expanded to float32 by
    transformers' GGUF reader; each GGML type still expanded named once in the log."""
    path = write_random_gguf("llama", tmp_path / "tiny-k.gguf", default_gguf_path(),
                             BLOCK_TYPES.get)  # fmt: skip
    assert path.stat().st_size < 16 << 20
    try:
        with caplog.at_level(logging.WARNING, logger="pagedserve.engine.loader.gguf_weights"):
            llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02, quantization="gguf", quantized_activations="float")
        # served in its own blocks: only the header was converted, no tensor expanded
        served = llm.engine.settings.model_path
        assert served.name == gguf_model_dir(path).name + "-header"
        assert sorted(p.suffix for p in served.iterdir()) == [
            ".jinja", ".json", ".json", ".json", ".json", ".json"]
        assert not gguf_model_dir(path).exists()
        want = greedy(LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02))
        assert len({t for row in want for t in row}) > 5  # not one repeated token
        model = llm.engine.worker.model
        assert llm.engine.worker.quant_desc == "gguf (q4_k, q5_0, q5_1, q5_k, q6_k)"
        formats = [[getattr(p.weight, "fmt", None) for _, p in layer.linears()]
                   for layer in model.layers]  # fmt: skip
        assert formats == [["q4_k", "q5_0", "q5_k+q4_k", "q6_k"],
                           ["q4_k+q6_k", "q5_1", None, "q5_0"]]  # fmt: skip
        assert model.embed_tokens.weight.fmt == "q6_k" and model.lm_head is None
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF:")]
        assert len(logged) == 2, logged
        assert logged[0].startswith("GGUF: 1 Q3_K tensors expanded to float32")
        assert logged[1].startswith("GGUF: 1 Q5_0 tensors expanded to float32: fused")
        assert greedy(llm) == want
    finally:
        shutil.rmtree(gguf_model_dir(path), ignore_errors=True)  # its float32 conversion


QWEN2_TYPES = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
"""The types of a Qwen2 file's embedding and logits; its other weights are Q4_0."""


def test_qwen2_gguf_equals_hf_on_the_file():
    """A Qwen2 file (``qwen2`` tensor names, q/k/v biases, q/k rows as its converter
    writes them: not permuted, unlike Llama's) of random Q4_0 weights and a Q8_0
    embedding and ``output.weight``: served from its blocks, and expanded, the greedy
    tokens of HF transformers on the same file (the file, its conversion and the
    reference made once, in the cache)."""
    path = cached_random_gguf("qwen2", default_gguf_path(), QWEN2_TYPES, "Q4_0", tied=False)
    want = hf_greedy(convert_gguf_model(path), PROMPTS, NEW)
    assert len({t for row in want for t in row}) > 5  # not one repeated token
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02, quantization="gguf", quantized_activations="float")
    assert llm.engine.settings.hf_config.model_type == "qwen2"
    assert llm.engine.worker.quant_desc == "gguf (q4_0, q8_0)"
    model = llm.engine.worker.model
    assert model.layers[0].qkv_proj.weight.fmt == "q4_0"
    assert model.lm_head.weight.fmt == "q8_0"
    assert greedy(llm) == want
    assert greedy(LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)) == want


def test_a_tensor_of_partial_blocks_is_refused_by_name(tmp_path):
    from pagedserve.engine.loader import gguf_weights

    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' \(Q4_K\): its rows of 320 "
                                         r"weights are not whole blocks of 256"):
        gguf_weights._kept_format("blk.0.attn_q.weight", "Q4_K", 320)


def test_gemma_header_rules(tmp_path):
    """llama.cpp's rules where a Gemma file says nothing: Gemma 2 caps at 50 and 30."""
    from tests.helpers.gguf_files import write_header_only

    g2 = write_header_only("gemma2", {"block_count": 26, "embedding_length": 2304,
                                      "attention.head_count": 8, "attention.key_length": 256},
                           tmp_path / "g2.gguf")  # fmt: skip
    assert config_overrides(g2) == {"query_pre_attn_scalar": 256,
                                    "attn_logit_softcapping": 50.0,
                                    "final_logit_softcapping": 30.0}
    # Gemma 2 27B: 46 layers, scores scaled by hidden / heads = 144.
    big = write_header_only("gemma2", {"block_count": 46, "embedding_length": 4608,
                                       "attention.head_count": 32, "attention.key_length": 128,
                                       "attn_logit_softcapping": 40.0}, tmp_path / "27b.gguf")
    got = config_overrides(big)
    assert got["query_pre_attn_scalar"] == 144 and got["attn_logit_softcapping"] == 40.0


def test_unserved_architecture_is_refused_before_conversion(tmp_path):
    from tests.helpers.gguf_files import write_header_only

    path = write_header_only("starcoder2", {"block_count": 2}, tmp_path / "sc2.gguf")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"general.architecture='starcoder2' is not supported; "
                                         r"supported: llama, .*gemma3"):
        LLM(str(path))
    assert time.monotonic() - start < 30
    assert not gguf_model_dir(path).exists()
