"""Sliding-window attention and the Gemma 2/3 decoders: greedy output equal to HF
transformers (float32) on tiny random models whose window (12, 16 or 20 positions) is far
shorter than the prompts, on every CPU attention path (the torch backend and the native
one at each build level this CPU runs), through chunked prefill, prefix-cache hits,
preemption and ``n`` > 1."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.models.spec import DecoderSpec
from pagedserve.kernels.cpu import native
from tests.helpers.hf import hf_greedy
from tests.helpers.kernels import native_level_params

ARCHS = ("gemma2", "gemma3", "mistral_window", "phi3_window")
"""Gemma 2 (sliding and full layers in turn, capped scores and logits, window 12),
Gemma 3 (two sliding layers with a local RoPE to one full layer with a scaled global
RoPE, QK norms, window 12), a Mistral whose every layer slides over 20 positions and a
Phi-3 (fused checkpoint tensors) whose every layer slides over 16."""
BACKENDS = ["torch", *native_level_params(prefix="cpu-")]
NEW = 10


def prompt(n: int, seed: int) -> list[int]:
    return [(37 * j + 11 * seed) % 20000 + 100 for j in range(n)]


# Shorter than the windows, and about 3x and 5x the longer one.
PROMPTS = [prompt(7, 0), prompt(61, 1), prompt(100, 2)]


def engine(path, backend: str, monkeypatch, **extra) -> LLM:
    name, _, level = backend.partition("-")
    if level:
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", level)
    return LLM(str(path), dtype="float32", attention_backend=name, kv_cache_memory_gb=0.02,
               max_num_batched_tokens=24, **extra)  # chunked prefills beside decodes


def greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, n=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf(arch, backend, tiny_model_factory, monkeypatch):
    path = tiny_model_factory(arch)
    llm = engine(path, backend, monkeypatch)
    name, _, level = backend.partition("-")
    attn = llm.engine.worker.attn
    assert attn.name == name and (not level or native.isa(attn._lib) == level)
    fused = []  # with the native float32 linear, steps run every layer in one call
    if name == "cpu" and attn.fuses_layers:
        run = attn._fused.run
        monkeypatch.setattr(attn._fused, "run", lambda *a: fused.append(run(*a)) or fused[-1])
    assert [o[0] for o in greedy(llm, PROMPTS)] == hf_greedy(path, PROMPTS, NEW)
    if name == "cpu" and attn._lib.gemm_f32_available():
        assert sum(r is not None for r in fused) >= NEW


@pytest.mark.parametrize("backend", ("torch", "auto"))
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_preemption_and_n_equal_hf(arch, backend, tiny_model_factory, monkeypatch):
    """Prompts sharing a 70-token prefix (the window cuts into it), twice: the second
    pass hits the prefix cache; a pool too small for all of them at once preempts; n=2
    gives two greedy copies."""
    import transformers

    from pagedserve.blockmgr.groups import KVGroups

    path = tiny_model_factory(arch)
    shared = prompt(70, 3)
    prompts = [shared + prompt(5 + 4 * i, 10 + i) for i in range(6)]
    spec = DecoderSpec.from_hf(transformers.AutoConfig.from_pretrained(path))
    groups = KVGroups.of_layers([spec.window(i) or None for i in range(spec.num_layers)])
    # room for the longest request alone (its full tables and windows) and a few more
    num_blocks = groups.peak_blocks(16, 110, 24) + 4
    llm = engine(path, backend, monkeypatch, num_gpu_blocks_override=num_blocks, max_num_seqs=6)
    assert llm.engine.kv.windows == groups.windows
    want = hf_greedy(path, prompts, NEW)
    for _ in range(2):
        assert greedy(llm, prompts, n=2) == [[w, w] for w in want]
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0, "the run was meant to preempt"
    assert eng.kv.stats().prefix_cache_hits > 0, "the run was meant to hit the cache"
    assert eng.kv.stats().num_free_blocks == eng.kv.num_blocks


def test_specs_read_the_configs(tiny_model_factory):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(tiny_model_factory("gemma3"))
    spec = DecoderSpec.from_hf(cfg)
    assert spec.windows == (12, 12, 0) and spec.rope_keys == (
        "sliding_attention", "sliding_attention", "full_attention")
    assert spec.gemma_norms and spec.qk_norm and spec.activation == "gelu_tanh"
    assert spec.scale == 32 ** -0.5 and spec.head_dim == 32 and spec.hidden_size == 64
    assert not spec.attn_softcap and not spec.final_softcap
    g2 = DecoderSpec.from_hf(transformers.AutoConfig.from_pretrained(
        tiny_model_factory("gemma2")))
    assert g2.windows == (12, 0) and g2.rope_keys == () and not g2.qk_norm
    assert (g2.attn_softcap, g2.final_softcap, g2.scale) == (8.0, 6.0, 24 ** -0.5)
    mistral = DecoderSpec.from_hf(transformers.AutoConfig.from_pretrained(
        tiny_model_factory("mistral_window")))
    assert mistral.windows == (20, 20) and not mistral.gemma_norms
    llama_cfg = transformers.AutoConfig.from_pretrained(tiny_model_factory("llama"))
    llama_cfg.sliding_window = 16  # a stray key: HF's Llama never slides
    llama = DecoderSpec.from_hf(llama_cfg)
    assert llama.windows == ()


def test_what_gemma_configs_refuse(tiny_model_factory):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(tiny_model_factory("gemma2"))
    cfg.hidden_activation = "relu"
    with pytest.raises(ValueError, match="hidden_activation='relu' is not supported"):
        DecoderSpec.from_hf(cfg)
    cfg = transformers.AutoConfig.from_pretrained(tiny_model_factory("gemma3"))
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        DecoderSpec.from_hf(cfg)
    cfg = transformers.AutoConfig.from_pretrained(tiny_model_factory("gemma3"))
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}  # one RoPE only
    with pytest.raises(ValueError, match="per-layer-type rope_parameters"):
        DecoderSpec.from_hf(cfg)
    cfg = transformers.AutoConfig.from_pretrained(tiny_model_factory("mixtral"))
    cfg.hidden_act = "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        DecoderSpec.from_hf(cfg)


@pytest.mark.parametrize("arch", ("gemma2", "gemma3"))
def test_tensor_parallel_2_equals_hf(arch, tiny_model_factory):
    """Each rank holds half the heads; the output norms come after the all-reduces."""
    path = tiny_model_factory(arch)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, kv_cache_memory_gb=0.02,
             max_num_batched_tokens=24) as llm:  # fmt: skip
        assert llm.engine.worker.spec.num_heads == 2
        assert [o[0] for o in greedy(llm, PROMPTS)] == hf_greedy(path, PROMPTS, NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_verification_equals_hf(arch, tiny_model_factory, monkeypatch):
    """n-gram drafts verified through the windowed prefill paths: HF's tokens, with drafts
    kept (the Gemma models repeat themselves, which the proposer copies; a text and its
    greedy continuation given twice, so that what follows the second copy can be drafted
    from the first)."""
    path = tiny_model_factory(arch)
    q = prompt(45, 9)
    w = hf_greedy(path, [q], NEW)[0]
    prompts = [q + w + q + w[:3], prompt(9, 4) * 5, *PROMPTS]
    llm = engine(path, "auto", monkeypatch, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    assert [o[0] for o in greedy(llm, prompts)] == hf_greedy(path, prompts, NEW)
    st = llm.engine.scheduler.spec_stats
    assert st.num_accepted_tokens > 0, st


def test_the_text_model_of_a_gemma3_image_and_text_checkpoint(tiny_model_factory):
    """``Gemma3ForConditionalGeneration``: its text model serves text prompts (its vision
    tower's tensors are not read); HF's whole model on the same token ids agrees."""
    path = tiny_model_factory("gemma3_mm")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)
    spec = llm.engine.worker.model.spec
    assert spec.windows == (12, 12, 0) and spec.gemma_norms and spec.tie_word_embeddings
    assert [o[0] for o in greedy(llm, PROMPTS)] == hf_greedy(path, PROMPTS, NEW)


def test_a_long_gemma3_request_keeps_its_windows_not_its_context(tiny_model_factory, monkeypatch):
    """Gemma 3's five sliding layers to one full one: while a 600-token request decodes
    it holds one full table and about a window per sliding group (under a third of
    what six full tables would), the block map shows those blocks, its output equals
    HF's, and every block returns to the pool at the end."""
    from pagedserve.engine.core.kv_state import take_kv_state

    path = tiny_model_factory("gemma3_6")
    llm = engine(path, "auto", monkeypatch)
    eng = llm.engine
    assert eng.kv.windows == (None, 12, 12, 12, 12, 12)
    ids = prompt(600, 7)
    eng.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                min_tokens=NEW))  # fmt: skip
    (rid,) = eng.scheduler.requests
    tokens, held = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = list(out.outputs[0].token_ids)
        if eng.kv.num_allocated_blocks(rid):
            held.append(eng.kv.num_allocated_blocks(rid))
            state = take_kv_state(eng.scheduler, 0.0)
            (req,) = state.requests
            assert req.num_blocks == held[-1]
            assert sum(count for _, count in req.block_runs) == held[-1]
            assert state.counters["num_kv_groups"] == 6
            assert state.counters["num_used_blocks"] == held[-1]
    full = -(-(600 + NEW) // 16)
    window_blocks = -(-(12 - 1 + 24) // 16) + 1  # a window and a chunk of 24
    assert max(held) <= full + 5 * window_blocks
    assert held[-1] < 6 * full / 3
    assert tokens == hf_greedy(path, [ids], NEW)[0]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
