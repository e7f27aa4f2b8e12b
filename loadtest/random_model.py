"""A random-weight model shaped like the default one, with head counts of one's choice.

The default model's 9 attention heads and 3 KV heads split only 3 ways; tensor-parallel
benchmarks at 2 ranks need a model whose heads split in two. This writes one with the
default model's layers, widths, vocabulary, tokenizer and chat template, and
``--num-heads``/``--num-kv-heads`` heads of the same size (64), so its cost per token is
close to the default model's::

    python -m pagedserve.loadtest.random_model /tmp/smollm2-8h --num-heads 8 --num-kv-heads 2
    pagedserve bench throughput --model /tmp/smollm2-8h --tensor-parallel-size 2

With ``--experts E --experts-per-token K`` it is a Mixtral of the same shape whose MLPs
are E experts of 1/K the default's width: a token's experts do the default MLP's
arithmetic, so a benchmark against the dense model measures what routing costs::

    python -m pagedserve.loadtest.random_model /tmp/smollm2-moe --num-heads 9 --num-kv-heads 3 \
        --experts 16 --experts-per-token 4
"""

from __future__ import annotations

import argparse
from pathlib import Path


def write(out: Path, num_heads: int, num_kv_heads: int, seed: int = 0, experts: int = 0,
          experts_per_token: int = 2) -> Path:  # fmt: skip
    import torch
    import transformers

    from pagedserve.engine.loader import convert_default_model, load_tokenizer

    src = convert_default_model()
    cfg = transformers.AutoConfig.from_pretrained(src)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cfg.num_attention_heads, cfg.num_key_value_heads = num_heads, num_kv_heads
    cfg.head_dim = head_dim
    cls = transformers.LlamaForCausalLM
    if experts:
        if cfg.intermediate_size % experts_per_token:
            raise SystemExit(f"--experts-per-token={experts_per_token} does not divide the "
                             f"MLP width {cfg.intermediate_size}")
        fields = cfg.to_dict()
        for key in ("architectures", "model_type", "transformers_version"):
            fields.pop(key, None)
        fields["intermediate_size"] //= experts_per_token
        cfg = transformers.MixtralConfig(**fields, num_local_experts=experts,
                                         num_experts_per_tok=experts_per_token)  # fmt: skip
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    model.save_pretrained(out)
    load_tokenizer(src).save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pagedserve.loadtest.random_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=0,
                   help="a Mixtral with this many experts per layer (default: dense)")
    p.add_argument("--experts-per-token", type=int, default=2)
    a = p.parse_args()
    print(write(a.out, a.num_heads, a.num_kv_heads, a.seed, a.experts, a.experts_per_token))


if __name__ == "__main__":
    main()
