"""The whole engine on the Triton attention backend gives the torch backend's greedy tokens.

A tiny random model, prompts of non-block-multiple lengths and a small token budget, so
that prefill chunks, mixed steps and decodes all run through the Triton kernels. The
decode-only steps run a second time through the padded decode runner of
:mod:`pagedserve.engine.worker.cuda_graphs` (split-KV launches sized for ``max_model_len``, padded rows).

Without CUDA the kernels run in the Triton interpreter, which must be switched on
before triton is first imported: the Triton engine runs in a subprocess (this file run
as a script, ``TRITON_INTERPRET=1``) and prints its tokens. With CUDA everything runs in
this process, compiled, with the decode steps as captured CUDA graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.models import write_tiny_model
from tests.helpers.subprocess import run_as_script

CUDA = torch.cuda.is_available()
NEW_TOKENS = 8
BATCHED_TOKENS = 16
PROMPT_LENS = (21, 38)
MIXED_PROMPT_LENS = (3, 50, 9, 17, 5)
"""Staggered prefills beside 1-4 decodes: every count of decodes before the prefills,
block tables of many widths."""
KV_GB = 0.25


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama-synthetic")))


def prompts(lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lens]


def engine_kwargs(backend: str, device: str, **extra) -> dict:
    return dict(attention_backend=backend, device=device, dtype="float32",
                max_num_batched_tokens=BATCHED_TOKENS, enable_prefix_caching=False,
                kv_cache_memory_gb=KV_GB, max_num_seqs=4, **extra)  # fmt: skip


def generate(llm, lens=PROMPT_LENS) -> list[list[int]]:
    from pagedserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(lens)], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def triton_tokens_interpreted(model: str) -> dict[str, list]:
    """Run in the subprocess: the Triton engine on the CPU, then again with its decode
    steps on the padded decode runner (eager, as a graph would run them); with the
    specialization keys of the kernel launches after the engine's warm-up that it had
    not launched (what a GPU would compile mid-serving)."""
    from pagedserve import LLM
    from pagedserve.engine.worker.cuda_graphs import DecodeGraphRunner, capture_sizes
    from tests.helpers.triton_keys import LaunchKeys, triton_kernels

    keys = LaunchKeys(triton_kernels())
    llm = LLM(model=model, **engine_kwargs("triton", "cpu"))
    w = llm.engine.worker
    assert w.attn.name == "triton"
    warm = keys.distinct()
    num_warm = len(keys.keys)
    eager = generate(llm)
    if w.kv_groups.num_groups > 1:  # one block table per group: the padded runner holds one
        mixed = generate(llm, MIXED_PROMPT_LENS)
        return {"eager": eager, "mixed": mixed, "keys": [len(warm), sorted(
            map(repr, keys.distinct(num_warm) - warm))]}
    runner = DecodeGraphRunner(w.model, w.attn, w.runner.kv_caches, w.config.block_size,
                               w.settings.max_model_len, capture_sizes(w.config.max_num_seqs),
                               w.settings.device, use_graphs=False)  # fmt: skip
    w.runner.decode_graphs = runner
    padded = generate(llm)
    assert runner.num_replays >= NEW_TOKENS - 1, runner.num_replays
    mixed = generate(llm, MIXED_PROMPT_LENS)
    new = sorted(map(repr, keys.distinct(num_warm) - warm))
    return {"eager": eager, "padded": padded, "mixed": mixed, "keys": [len(warm), new]}


@pytest.mark.parametrize("model", ["llama", "qwen2_moe", "gemma2", "gemma3"])
def test_triton_engine_matches_torch_backend(model, tiny_llama, tiny_model_factory) -> None:
    """Also a model with experts (a shared one, and a dense layer): on CUDA its decode
    steps run eagerly (no graphs), here also through the padded decode runner; and Gemma
    2/3, whose 12-position sliding windows the prompts (up to 50 tokens) pass, with
    Gemma 2's capped scores (the torch backend's tokens are HF's,
    tests/engine/models/test_sliding_window.py)."""
    from pagedserve import LLM

    path = tiny_llama if model == "llama" else str(tiny_model_factory(model))
    device = "cuda" if CUDA else "cpu"
    ref = generate(LLM(model=path, **engine_kwargs("torch", device)))
    assert all(len(t) == NEW_TOKENS for t in ref)
    if CUDA:
        graphs = LLM(model=path, **engine_kwargs("triton", "cuda"))
        runner = graphs.engine.worker.runner.decode_graphs
        got = {"graphs": generate(graphs)}
        if model == "llama":
            assert runner is not None and runner.use_graphs
            assert runner.num_replays >= NEW_TOKENS - 1
        else:
            assert runner is None
        del graphs, runner
        got["eager"] = generate(LLM(model=path, **engine_kwargs("triton", "cuda",
                                                                enforce_eager=True)))  # fmt: skip
    else:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(run_as_script(__file__, path), env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        num_warm, new_keys = got.pop("keys")
        assert num_warm >= 5, num_warm  # KV write, prefill, decode 1 split / several, reduce
        assert new_keys == [], "kernel variants first launched after warm-up:\n" + \
            "\n".join(new_keys)  # fmt: skip
        mixed = got.pop("mixed")
        assert mixed == generate(LLM(model=path, **engine_kwargs("torch", device)),
                                 MIXED_PROMPT_LENS)  # fmt: skip
    for name, tokens in got.items():
        assert tokens == ref, f"triton ({name}) {tokens} != torch {ref}"


@pytest.mark.skipif(not CUDA, reason="needs CUDA; on the CPU, test_lora.py runs adapters "
                    "through the padded decode buffers and test_embed.py the pooling")
def test_adapters_and_embeddings_on_cuda(tiny_llama, tmp_path) -> None:
    """On the GPU: a LoRA adapter's tokens and mean-pooled embeddings on the Triton
    backend with decode CUDA graphs equal the torch backend's; adapter steps are never
    replayed from a graph, base-model steps still are."""
    from pagedserve import LLM, LoRARequest, PoolingParams, SamplingParams
    from tests.helpers.lora import make_adapter

    adapter = LoRARequest("a", 1, str(make_adapter(tiny_llama, tmp_path / "a", rank=8)))
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    batch = [{"prompt_token_ids": p} for p in prompts(MIXED_PROMPT_LENS)]

    def run(llm):
        toks = [list(o.outputs[0].token_ids) for o in llm.generate(
            batch, sp, use_tqdm=False, lora_request=adapter)]  # fmt: skip
        vecs = [o.embedding for o in llm.embed(batch, PoolingParams(pooling_type="MEAN"),
                                               use_tqdm=False)]  # fmt: skip
        return toks, torch.tensor(vecs)

    ref_toks, ref_vecs = run(LLM(model=tiny_llama, **engine_kwargs("torch", "cuda",
                                                                   enable_lora=True)))
    llm = LLM(model=tiny_llama, **engine_kwargs("triton", "cuda", enable_lora=True))
    runner = llm.engine.worker.runner.decode_graphs
    assert runner is not None and runner.use_graphs
    before = runner.num_replays
    toks, vecs = run(llm)
    assert runner.num_replays == before
    assert toks == ref_toks and torch.allclose(vecs, ref_vecs, rtol=1e-4, atol=1e-5)
    generate(llm)
    assert runner.num_replays >= before + NEW_TOKENS - 1


@pytest.mark.skipif(not CUDA, reason="needs CUDA; on the CPU, test_checkpoint_quant.py runs "
                    "GPTQ/AWQ checkpoints and tests/kernels the Triton quantized product")
def test_quantized_checkpoint_on_cuda(tiny_llama, tmp_path) -> None:
    """On the GPU: an act-order GPTQ checkpoint with zero points (q4_1 planes and input
    orders on the device) on the Triton backend with decode CUDA graphs gives the torch
    backend's tokens."""
    from pagedserve import LLM
    from tests.helpers.quantized_checkpoints import Scheme, write_quantized

    write_quantized(Path(tiny_llama), tmp_path / "q", tmp_path / "ref",
                    Scheme(group_size=32, sym=False, desc_act=True, checkpoint_format="gptq_v2"))
    ref = generate(LLM(model=str(tmp_path / "q"), **engine_kwargs("torch", "cuda")))
    llm = LLM(model=str(tmp_path / "q"), **engine_kwargs("triton", "cuda"))
    qkv = llm.engine.worker.model.layers[0].qkv_proj
    assert qkv.weight.fmt == "q4_1" and qkv.weight.device.type == "cuda"
    assert qkv.input_order is not None and qkv.input_order.device.type == "cuda"
    assert generate(llm) == ref


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(triton_tokens_interpreted(sys.argv[1])))
