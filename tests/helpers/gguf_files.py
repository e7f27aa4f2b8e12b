"""GGUF files of tiny Hugging Face models, written as llama.cpp's converter writes them.

Tensors are named and laid out as ``convert_hf_to_gguf.py`` does for the architecture
(Gemma: norms stored as ``1 + weight``, q/k rows not permuted); the tokenizer fields are
the default model's (the tiny models use its tokenizer). Float tensors are F32 (norms
always), the others F32 or Q8_0.
"""

from __future__ import annotations

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
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for field in reader.fields.values():
        if field.name == "tokenizer.chat_template" and chat_template is not None:
            writer.add_chat_template(chat_template)
        elif field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
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


def write_header_only(arch: str, fields: dict, out: Path) -> Path:
    """A GGUF file ``out`` of architecture ``arch`` with ``fields`` (``{arch}.`` keys, ints
    as uint32, floats as float32) and one small tensor: a header to read."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch=arch)
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
