"""GGUF files of the default model in each format the engine keeps quantized, served from
their own blocks, equal HF transformers on the same file token for token."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from tests.helpers.hf import greedy_tokens, hf_greedy
from tests.helpers.prompts import PROMPTS, default_prompt_ids

SCHEDULE_FIRST = True
"""Among the longest modules of the suite: started first (``tests/conftest.py``)."""


@pytest.fixture(scope="module")
def default_prompts(default_tokenizer):
    return default_prompt_ids(default_tokenizer)


GGUF_FILES = {
    "q8_0": "gguf (q8_0)",
    "q4_0": "gguf (q4_0)",
    "q5_0": "gguf (q5_0)",
    "q5_1": "gguf (q5_1)",
    "q4_k_m": "gguf (q4_k, q5_0, q6_k, q8_0)",
    "q5_k_m": "gguf (q5_1, q5_k, q6_k, q8_0)",
    "q6_k": "gguf (q6_k, q8_0)",
}
"""The default model's GGUF files made by ``loadtest.gguf_requant`` and the formats the
engine keeps them in. The K-quant recipes hold K-quants only in ``ffn_down`` (the one
weight whose rows are whole 256-weight blocks) and their fallbacks elsewhere."""


@pytest.mark.parametrize("fmt", list(GGUF_FILES))
def test_a_gguf_file_served_in_its_own_format_matches_hf_on_that_file(
        fmt, tmp_path, monkeypatch, default_prompts):  # fmt: skip
    """Any GGUF file as the model: the default model's re-encoded in ``fmt`` (a single
    type for every linear and the embedding, or llama-quantize's Q4_K_M, Q5_K_M or Q6_K
    mix), served from its own blocks, equals HF transformers on the same file (the folder
    it converts to)."""
    from pagedserve.engine import envs
    from pagedserve.engine.loader import default_gguf_path, resolve_model_path
    from pagedserve.engine.loader.gguf_file import read_header
    from pagedserve.engine.worker.kernel_settings import kernel_settings
    from pagedserve.loadtest.gguf_requant import FILE_TYPES, requantize

    # The file's conversions go to a cache of their own; the native library, built once
    # for the suite, is shared (rebuilding it took longer than the rest of a case).
    kernels = kernel_settings().kernel_dir
    kernels.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv(envs.CACHE.name, str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / kernels.name).symlink_to(kernels, target_is_directory=True)
    assert kernel_settings().kernel_dir.resolve() == kernels.resolve()
    path = tmp_path / f"SmolLM2-135M-Instruct.{fmt.upper()}.gguf"
    assert requantize(default_gguf_path(), path, fmt) > 0
    file_type = read_header(path).fields["general.file_type"]
    assert file_type == FILE_TYPES[fmt.upper()]
    # The reference first: the engine then takes its config and tokenizer from the
    # folder the file converted into (the header-only conversion has tests of its own).
    want = hf_greedy(resolve_model_path(str(path)), default_prompts[:4], 32)
    llm = LLM(model=str(path), quantization="gguf", quantized_activations="float", max_num_batched_tokens=24)
    assert llm.engine.worker.quant_desc == GGUF_FILES[fmt]
    assert greedy_tokens(llm, default_prompts[:4], 32) == want


def test_gguf_prefill_chunks_of_hundreds_of_rows_match_hf(default_model_path, default_tokenizer):
    """Prompts of 300-1,000 tokens, each prefilled in one chunk (one request a step):
    chunks the quantized kernel multiplies in registers up to its row limit (1,024 on
    AVX-512) and that dequantize the weights above it. Equal to HF transformers on the
    same GGUF token for token."""
    text = " ".join(PROMPTS)
    ids = default_tokenizer.encode(" ".join([text] * 40))
    prompts = [ids[:n] for n in (300, 700, 1000)]
    assert all(len(p) == n for p, n in zip(prompts, (300, 700, 1000), strict=True))
    llm = LLM(quantization="gguf", quantized_activations="float", enable_prefix_caching=False)
    got = [greedy_tokens(llm, [p], 16)[0] for p in prompts]
    assert llm.engine.kv.stats().num_free_blocks == llm.engine.kv.num_blocks
    del llm
    assert got == hf_greedy(default_model_path, prompts, 16)
