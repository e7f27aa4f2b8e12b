"""Tiny random-weight models (written to a folder, or built in memory) for engine tests that
need no download."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from pagedserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec


def write_tiny_model(out: Path, vocab_size: int = 49152, seed: int = 0) -> Path:
    """A tiny random Llama (float32; 2 layers, hidden 64, GQA 4/2) with a synthetic
    word-level tokenizer, so that it needs no downloaded files."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # large weights: peaked logits, no greedy near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>")  # fmt: skip
    fast.save_pretrained(out)
    return out


def tiny_decoder(max_model_len: int = 128) -> DecoderForCausalLM:
    """A two-layer decoder (GQA, head dim 8, vocab 97) with seeded random weights."""
    spec = DecoderSpec(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False,
        mlp_bias=False, qk_norm=False, tie_word_embeddings=False,
        max_position_embeddings=max_model_len,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderForCausalLM(spec).eval()
    model.set_rope(SimpleNamespace(rope_theta=10000.0), max_model_len)
    return model
