"""GGUF files of tiny Hugging Face models, written as llama.cpp's converter writes them.

Tensors are named and laid out as ``convert_hf_to_gguf.py`` does for the architecture
(Gemma: norms stored as ``1 + weight``, q/k rows not permuted); the tokenizer fields are
the default model's (the tiny models use its tokenizer). Float tensors are F32 (norms
always), the others F32 or Q8_0.

:func:`write_random_gguf` writes a model of random weights straight into a GGUF file (no
Hugging Face folder: a small file, whatever its width), each 2-D weight in the GGML type
asked for: random valid blocks for the block formats (any bytes are valid codes and
sub-block scales; the float16 scales are drawn so the weights spread about as a
normal of the given deviation does, centered), floats quantized by gguf-py for the
others.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

GEMMA_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    name = hf.removeprefix("model.").removesuffix(".weight")
    if name == "embed_tokens":
        return "token_embd.weight"
    if name == "norm":
        return "output_norm.weight"
    _, i, module = name.split(".", 2)
    return f"blk.{i}.{GEMMA_TENSORS[module]}.weight"


@functools.lru_cache(maxsize=4)
def tokenizer_fields(tokenizer_gguf: Path) -> tuple[tuple[str, object, object, object], ...]:
    """The ``tokenizer.`` fields of a GGUF file as ``(name, value, type, item type)``, read
    once a process (the ``gguf`` package takes seconds over a 49k-token vocabulary)."""
    import gguf

    out = []
    for field in gguf.GGUFReader(str(tokenizer_gguf)).fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            out.append((field.name, field.contents(), kind, sub))
    return tuple(out)


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}")
"""Gemma 3's turn format (its template without the system-prompt folding)."""


def write_gemma3_gguf(hf_dir: Path, out: Path, tokenizer_gguf: Path,
                      quantized: str | None = None,
                      chat_template: str | None = None) -> Path:  # fmt: skip
    """The Gemma 3 model at ``hf_dir`` as a GGUF file ``out`` (``quantized="Q8_0"``: its
    2-D weights in Q8_0; ``chat_template``: the file's template instead of the default
    model's)."""
    import gguf
    import transformers
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    weights = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch="gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    full = cfg.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    for name, value, kind, sub in tokenizer_fields(Path(tokenizer_gguf)):
        if name == "tokenizer.chat_template" and chat_template is not None:
            writer.add_chat_template(chat_template)
        else:
            writer.add_key_value(name, value, kind, sub_type=sub)
    for hf, tensor in weights.items():
        data = tensor.to(torch.float32)
        if hf.endswith("norm.weight"):
            data = data + 1.0
        array = np.ascontiguousarray(data.numpy())
        if quantized and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantized]
            writer.add_tensor(_gguf_name(hf), gguf.quants.quantize(array, qtype),
                              raw_dtype=qtype)  # fmt: skip
        else:
            writer.add_tensor(_gguf_name(hf), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_header_only(arch: str, fields: dict, out: Path, strings: dict | None = None) -> Path:
    """A GGUF file ``out`` of architecture ``arch`` with ``fields`` (``{arch}.`` keys, ints
    as uint32, floats as float32), ``strings`` (whole keys) and one small tensor: a header
    to read."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch=arch)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    for key, value in fields.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Per GGML type: (bytes a block, weights a block, offset of d, offset of the offset's
# float16 (-1: none), the offset as a multiple of d that centers the weights, the
# weights' standard deviation in units of d). The deviations follow from codes and
# sub-block scales drawn uniformly: Q5_0 d(q - 16); Q5_1 dq + m; Q4_K/Q5_K d sc q - dmin
# mn with 6-bit sc, mn; Q6_K d sc (q - 32) with int8 sc; Q3_K roughly.
_RANDOM_BLOCKS = {
    "Q5_0": (22, 32, 0, -1, 0.0, 9.23),
    "Q5_1": (24, 32, 0, 2, -15.5, 9.23),
    "Q4_K": (144, 256, 0, 2, 7.5, 258.3),
    "Q5_K": (176, 256, 0, 2, 15.5, 527.0),
    "Q6_K": (210, 256, 208, -1, 0.0, 1366.0),
    "Q3_K": (110, 256, 108, -1, 0.0, 46.0),
}


def random_block_bytes(type_name: str, n: int, k: int, std: float,
                       g: torch.Generator) -> np.ndarray:  # fmt: skip
    """uint8 ``[n, k / block weights * block bytes]``: random valid blocks of GGML type
    ``type_name`` whose weights have about standard deviation ``std`` and mean 0."""
    size, width, d_at, m_at, center, spread = _RANDOM_BLOCKS[type_name]
    nb = k // width
    raw = torch.randint(0, 256, (n, nb, size), generator=g, dtype=torch.uint8)
    d = torch.randn(n, nb, generator=g) * (std / spread)
    raw[..., d_at:d_at + 2] = d.half().view(torch.uint8).view(n, nb, 2)
    if m_at >= 0:
        m = (d.half().float() * center).half()
        raw[..., m_at:m_at + 2] = m.view(torch.uint8).view(n, nb, 2)
    return raw.reshape(n, -1).numpy()


def write_random_gguf(arch: str, out: Path, tokenizer_gguf: Path,
                      types: Callable[[str], str] | str = "F32", seed: int = 0,
                      hidden: int = 256, inter: int = 512, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, head_dim: int = 64, std: float = 0.15,
                      tied: bool = True) -> Path:  # fmt: skip
    """A ``llama``, ``qwen2`` or ``gemma3`` model of random weights, written as llama.cpp's
    converter lays its tensors out, with the default model's tokenizer (``tokenizer_gguf``:
    its GGUF). ``types``: the GGML type of each 2-D weight, by GGUF tensor name (or one
    for all): F32, Q8_0/Q4_0/Q4_1 (quantized from normal floats of deviation ``std``) or
    a type of ``_RANDOM_BLOCKS`` (random blocks of about that deviation). Norms are F32
    near 1 (Gemma's stored as ``1 + weight``, as its converter writes them); Qwen2's q/k/v
    biases F32 of deviation ``std``. ``tied``: no ``output.weight`` (the logits read the
    embedding table)."""
    import gguf

    pick = (lambda _name: types) if isinstance(types, str) else types
    g = torch.Generator().manual_seed(seed)
    fields = tokenizer_fields(Path(tokenizer_gguf))
    vocab = next(len(value) for name, value, *_ in fields if name == "tokenizer.ggml.tokens")
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_name(f"tiny-random-{arch}")
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(12)
        writer.add_rope_freq_base_swa(10000.0)
    else:
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(vocab)
    for name, value, kind, sub in fields:
        writer.add_key_value(name, value, kind, sub_type=sub)

    def matrix(name: str, n: int, k: int) -> None:
        type_name = pick(name)
        if type_name in _RANDOM_BLOCKS:
            writer.add_tensor(name, random_block_bytes(type_name, n, k, std, g),
                              raw_dtype=gguf.GGMLQuantizationType[type_name])  # fmt: skip
            return
        floats = (torch.randn(n, k, generator=g) * std).numpy()
        if type_name == "F32":
            writer.add_tensor(name, floats)
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, gguf.quants.quantize(floats, qtype), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + torch.randn(size, generator=g) * 0.05).numpy())

    matrix("token_embd.weight", vocab, hidden)
    norm("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", vocab, hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        pre = f"blk.{i}."
        norm(pre + "attn_norm.weight", hidden)
        norm(pre + "ffn_norm.weight", hidden)
        if arch == "gemma3":
            for n in ("post_attention_norm", "post_ffw_norm"):
                norm(f"{pre}{n}.weight", hidden)
            for n in ("attn_q_norm", "attn_k_norm"):
                norm(f"{pre}{n}.weight", head_dim)
        for n, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden),
                              ("attn_v", kv, hidden), ("attn_output", hidden, q),
                              ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden),
                              ("ffn_down", hidden, inter)):  # fmt: skip
            matrix(f"{pre}{n}.weight", rows, cols)
        if arch == "qwen2":
            for n, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(f"{pre}{n}.bias", (torch.randn(rows, generator=g) * std).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def cached_random_gguf(arch: str, tokenizer_gguf: Path, types: dict[str, str],
                       other_type: str, **kwargs) -> Path:  # fmt: skip
    """:func:`write_random_gguf` (``types`` by tensor name, ``other_type`` for the other
    weights), written once into ``$PAGEDSERVE_CACHE/test-files`` (atomically) under a
    name keyed by the arguments, the code that writes it and the ``gguf`` package's
    version: the same path every run, so its conversion and its references are cached
    too."""
    from importlib.metadata import version

    from pagedserve.engine import envs

    key = json.dumps({"arch": arch, "types": types, "other": other_type, "kwargs": kwargs,
                      "tokenizer": tokenizer_gguf.stat().st_size, "gguf": version("gguf"),
                      "code": [inspect.getsource(f) for f in (write_random_gguf,
                                                              random_block_bytes)]},
                     sort_keys=True)  # fmt: skip
    folder = envs.cache_root() / "test-files"
    path = folder / f"tiny-random-{arch}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.gguf"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".gguf.tmp")
        os.close(fd)
        try:
            write_random_gguf(arch, Path(tmp), tokenizer_gguf,
                              lambda name: types.get(name, other_type), **kwargs)  # fmt: skip
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return path
