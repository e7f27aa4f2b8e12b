"""A GGUF file of Gemma 3 1B's shape with random weights, for timing against llama.cpp
where no Gemma 3 file can be downloaded.

    python scripts/gemma3_shape_gguf.py OUT.f32.gguf [--vocab 262144]
    llama-quantize OUT.f32.gguf OUT.Q4_K_M.gguf Q4_K_M

Gemma 3 1B's config (hidden 1,152, 26 layers, five sliding-window layers of 512 to one
global, 4 query heads and 1 KV head of 256, MLP 6,912, GELU-tanh, Gemma's norms, tied
embeddings, two RoPE bases), ``normal_(0, 0.02)`` weights, written as llama.cpp's
converter writes Gemma 3 (``tests/helpers/gguf_files.py``). The tokenizer is the embedded
default model's, 49,152 tokens; ``--vocab`` pads it with plain tokens ``zq0``, ``zq1``,
... (each with text, so every generated token streams some) up to Gemma 3's 262,144,
whose logits' weight is then the real one's size. Run from a checkout (it reads the test
helpers); it takes about 10 GiB of memory and writes 4 GB at the full vocabulary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMMA3_VOCAB = 262144


def padded_tokenizer(fields: tuple, vocab: int) -> tuple:
    """The default model's ``tokenizer.`` fields with ``vocab`` tokens, the added ones plain
    (token type 1)."""
    out = []
    for name, value, kind, sub in fields:
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores"):  # fmt: skip
            have = len(value)
            if vocab < have:
                raise SystemExit(f"--vocab {vocab} is below the tokenizer's {have} tokens")
            extra = {"tokenizer.ggml.tokens": [f"zq{i}" for i in range(vocab - have)],
                     "tokenizer.ggml.token_type": [1] * (vocab - have),
                     "tokenizer.ggml.scores": [0.0] * (vocab - have)}[name]  # fmt: skip
            value = list(value) + extra
        out.append((name, value, kind, sub))
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=49152,
                        help="tokens (49152: the default model's; 262144: Gemma 3's)")
    args = parser.parse_args()

    import tempfile

    import torch
    import transformers

    from pagedserve.engine.loader import default_gguf_path
    from tests.helpers import gguf_files

    fields = padded_tokenizer(gguf_files.tokenizer_fields(default_gguf_path()), args.vocab)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=args.vocab, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    model.tie_weights()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        gguf_files.tokenizer_fields = lambda _path: fields
        gguf_files.write_gemma3_gguf(Path(tmp), args.out, default_gguf_path(),
                                     chat_template=gguf_files.GEMMA3_CHAT_TEMPLATE)  # fmt: skip
    print(args.out)


if __name__ == "__main__":
    main()
