"""Tiny random-weight models written to a folder, for engine tests that need no download."""

from __future__ import annotations

from pathlib import Path

import torch


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
