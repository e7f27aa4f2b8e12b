"""A random-weight model shaped like the default one, with head counts of one's choice.

The default model's 9 attention heads and 3 KV heads split only 3 ways; tensor-parallel
benchmarks at 2 ranks need a model whose heads split in two. This writes one with the
default model's layers, widths, vocabulary, tokenizer and chat template, and
``--num-heads``/``--num-kv-heads`` heads of the same size (64), so its cost per token is
close to the default model's::

    python -m loadtest.random_model /tmp/smollm2-8h --num-heads 8 --num-kv-heads 2
    pagedserve bench throughput --model /tmp/smollm2-8h --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
from pathlib import Path


def write(out: Path, num_heads: int, num_kv_heads: int, seed: int = 0) -> Path:
    import torch
    import transformers

    from engine.loader import convert_default_model, load_tokenizer

    src = convert_default_model()
    cfg = transformers.AutoConfig.from_pretrained(src)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cfg.num_attention_heads, cfg.num_key_value_heads = num_heads, num_kv_heads
    cfg.head_dim = head_dim
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    load_tokenizer(src).save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.random_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write(a.out, a.num_heads, a.num_kv_heads, a.seed))


if __name__ == "__main__":
    main()
