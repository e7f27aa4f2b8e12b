"""Shared fixtures: the embedded default model and tiny random-weight models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The repository's folders install as ``pagedserve.<folder>``; by their bare names they
# would shadow other distributions of those names (Hugging Face's ``kernels``, which
# transformers imports). ``tests`` is imported from the repository root, so the root stays
# on the path, but after site-packages; ``python -m``/``-c`` children do not put their
# working folder first (``PYTHONSAFEPATH``).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]
os.environ["PYTHONSAFEPATH"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """A module with ``RUN_IN_SUBPROCESS`` runs either its tests in this process or, when
    that is impossible (Triton already imported without the interpreter), only its
    ``test_in_subprocess`` runner, which runs the module in a fresh process. Modules with
    ``SCHEDULE_FIRST`` are collected first."""
    keep, drop = [], []
    for item in items:
        flag = getattr(item.module, "RUN_IN_SUBPROCESS", None)
        runner = item.name == "test_in_subprocess"
        (keep if flag is None or flag == runner else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # The longest modules first (``SCHEDULE_FIRST = True``), each module's tests in their
    # order: with two workers (``--dist loadfile`` deals modules out in this order) they
    # start at once on both, rather than one of them starting last and running on alone.
    items.sort(key=lambda item: not getattr(item.module, "SCHEDULE_FIRST", False))


def _native_levels() -> list:
    from tests.helpers.kernels import native_level_params

    return native_level_params()


WORKER_RSS_LIMIT = 3 << 30
"""A test process holding more than this after a test collects its garbage and gives the
heap's free memory back: an engine is freed by the cyclic collector, not when its last
name goes, and the engine's malloc tuning keeps freed memory in the process, so two
workers that each ran a large test could otherwise hold most of a 24 GiB host."""


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.fixture(autouse=True)
def _bounded_test_process_memory():
    yield
    if _rss_bytes() > WORKER_RSS_LIMIT:
        import gc

        from pagedserve.engine.worker import process_tuning

        gc.collect()
        process_tuning.return_free_memory()


@pytest.fixture(scope="session", params=_native_levels())
def native_lib(request):
    """The native CPU library at each build level (portable, AVX2, AVX-512; a level this
    CPU cannot run is a skip that says so); each build reports the vector path it runs."""
    from pagedserve.kernels.cpu import native as cpu_native

    lib = cpu_native.build_library(request.param)
    assert cpu_native.isa(lib) == request.param
    return lib


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted default model (converted once into the user cache)."""
    from pagedserve.engine.loader import convert_default_model

    return convert_default_model()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from pagedserve.engine.loader import load_tokenizer

    return load_tokenizer(default_model_path)


TINY_ARCHS = ("llama", "qwen2", "qwen3")


def make_tiny_model(arch: str, out: Path, tokenizer_src: Path, seed: int = 0,
                    vocab_size: int = 49152, max_position_embeddings: int = 1024) -> Path:
    """A tiny random-weight model (float32) with the default model's tokenizer (a
    ``vocab_size`` above its 49152 tokens pads the logits with rows of no token)."""
    import torch
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256})
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=10000.0)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "mixtral":  # every layer has 4 experts, 2 per token
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                         rope_theta=10000.0)
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen2_moe":  # layer 0: 6 experts and a shared one; layer 1: a dense MLP
        cfg = transformers.Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, mlp_only_layers=[1], rope_theta=10000.0)
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint
        cfg = transformers.Phi3Config(**common, rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 10000.0})
        cls = transformers.Phi3ForCausalLM
    elif arch == "gemma2":  # sliding and full layers in turn, soft-capped scores and logits
        cfg = transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=12, attn_logit_softcapping=8.0, final_logit_softcapping=6.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gemma3":  # two sliding layers (local RoPE) to one full (scaled global RoPE)
        cfg = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=32,
            query_pre_attn_scalar=32, sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0}})
        cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma3_6":  # Gemma 3's own layer pattern (5 sliding, 1 full), as in GGUFs
        cfg = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6, "tie_word_embeddings": True}, head_dim=32,
            query_pre_attn_scalar=32, sliding_window=12,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0}})
        cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma3_mm":  # Gemma 3's image-and-text checkpoint, with a tiny vision tower
        text = dict(common, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32,
                    sliding_window=12,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                           "rope_theta": 1000000.0}})
        text.pop("tie_word_embeddings")
        cfg = transformers.Gemma3Config(
            text_config=text, mm_tokens_per_image=4, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14))
        cls = transformers.Gemma3ForConditionalGeneration
    elif arch == "phi3_window":  # Phi-3-mini-4k's shape: fused checkpoint, every layer slides
        cfg = transformers.Phi3Config(**common, sliding_window=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0})
        cls = transformers.Phi3ForCausalLM
    elif arch == "mistral_window":  # every layer slides over its last 20 positions
        cfg = transformers.MistralConfig(**common, sliding_window=20, rope_theta=10000.0)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen3_moe":  # 8 experts, 3 per token, their weights renormalized
        cfg = transformers.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=True, rope_theta=10000.0)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights make the logits peaked, so greedy has no near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            else:  # norms and biases: not all ones / zeros, so their loading is tested
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    from pagedserve.engine.loader import load_tokenizer

    load_tokenizer(tokenizer_src).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def make_tiny():
    """:func:`make_tiny_model`, for tests that build a variant of their own."""
    return make_tiny_model


@pytest.fixture(scope="session")
def gemma3_gguf(tiny_model_factory, tmp_path_factory) -> Path:
    """A float32 GGUF file of the tiny 6-layer Gemma 3 (``gemma3_6``), written as llama.cpp's
    converter writes one, with Gemma 3's turn template (one file, converted once, for the
    tests that read one)."""
    from pagedserve.engine.loader import default_gguf_path
    from tests.helpers.gguf_files import GEMMA3_CHAT_TEMPLATE, write_gemma3_gguf

    return write_gemma3_gguf(tiny_model_factory("gemma3_6"),
                             tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf",
                             default_gguf_path(), chat_template=GEMMA3_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, default_model_path):
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(
                arch, tmp_path_factory.mktemp(f"tiny-{arch}"), default_model_path)
        return cache[arch]

    return get
