"""Random-weight model folders for the GPU checks (``scripts/gpu_check.py``): an HF
config per preset, weights drawn on any device, and a synthetic word-level tokenizer, so
that nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``w3 .. w{V-1}`` with ``<unk> <s> </s>`` = 0, 1, 2."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>")  # fmt: skip


def model_config(preset: str):
    """HF config of a preset: ``llama``/``qwen2``/``qwen3``/``qwen3_moe`` (tiny, as the CPU
    equivalence tests) or ``llama-1b`` (Llama-3.2-1B's shape, for the throughput bench)."""
    import transformers

    tiny = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )  # fmt: skip
    if preset == "llama":
        return transformers.LlamaConfig(
            **tiny, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256})  # fmt: skip
    if preset == "qwen2":
        return transformers.Qwen2Config(**tiny, rope_theta=10000.0)
    if preset == "qwen3":
        return transformers.Qwen3Config(**tiny, head_dim=32, rope_theta=10000.0)
    if preset == "qwen3_moe":  # 8 experts, 3 per token (as tests/conftest.py's)
        return transformers.Qwen3MoeConfig(
            **tiny, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            norm_topk_prob=True, rope_theta=10000.0)  # fmt: skip
    if preset == "llama-1b":
        return transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )  # fmt: skip
    raise ValueError(f"unknown preset {preset!r}")


def write_random_model(out: Path, preset: str, std: float, seed: int = 0,
                       device: str = "cpu", save_dtype: str = "float32",
                       cfg: Any = None) -> Path:  # fmt: skip
    """Random weights (matrices ~ N(0, std), norms ~ 1 + N(0, 0.05), biases ~ N(0, 0.05))
    drawn on ``device``, saved as one safetensors file with the config and tokenizer
    (``cfg``: an HF config instead of the preset's)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = model_config(preset) if cfg is None else cfg
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    del meta_model
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, save_dtype)
    tensors = {}
    for name, shape in shapes.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if len(shape) > 1:
            x *= std
        elif name.endswith("bias"):
            x *= 0.05
        else:
            x = 1.0 + 0.05 * x
        tensors[name] = x.to(dtype).cpu().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    synthetic_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out
