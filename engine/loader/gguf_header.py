"""What a GGUF file's header says about its model, read before anything is converted.

A GGUF file is converted to a Hugging Face folder by transformers' GGUF reader, which
takes many seconds for a real model. Its architecture is checked first, from the header
alone, so that a file this engine cannot serve (or a malformed one) is refused at once,
naming it. And the
reader leaves some of Gemma's settings at its configs' defaults although the file (or
llama.cpp's rules for it) says otherwise: :func:`config_overrides` gives the settings the
file holds, which the converted config then carries.
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.engine.errors import ModelFileError
from pagedserve.engine.loader.gguf_file import GGUFHeader, read_header

SERVED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3")
"""``general.architecture`` values whose conversion this engine serves (Phi-3's GGUF
config would lack its longrope factors: refused)."""
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Layer counts of the Gemma 27B models, whose scores llama.cpp scales by
``(hidden_size / num_heads) ** -0.5`` (every other size: ``head_dim ** -0.5``)."""


def _fields(path: Path) -> dict:
    """The header's key/value fields (arrays as lists), the tokenizer's left out; the
    header is read with bounds (:func:`pagedserve.engine.loader.gguf_file.read_header`:
    a malformed file is refused, naming what is wrong)."""
    return {name: value for name, value in read_header(path).fields.items()
            if not name.startswith("tokenizer.")}  # fmt: skip


def architecture(path: Path) -> str:
    """The file's ``general.architecture`` (a ``ValueError`` when it has none)."""
    arch = _fields(path).get("general.architecture")
    if not arch:
        raise ValueError(f"GGUF file {str(path)!r} has no general.architecture")
    return arch


def check_served(path: Path) -> str:
    """The file's architecture, or a ``ValueError`` naming it when this engine does not
    serve it, or a :class:`ModelFileError` when the model's sizes in its header are not
    those of its tensors (read from the header: nothing is converted)."""
    header = read_header(path)
    arch = header.fields.get("general.architecture")
    if not arch:
        raise ValueError(f"GGUF file {str(path)!r} has no general.architecture")
    if arch not in SERVED_ARCHITECTURES:
        raise ValueError(f"GGUF file {str(path)!r}: general.architecture={arch!r} is not "
                         f"supported; supported: {', '.join(SERVED_ARCHITECTURES)}")
    _check_sizes(path, arch, header)
    return arch


MAX_CONTEXT_LENGTH = 1 << 24
"""A GGUF file's ``context_length`` at most (the RoPE tables are built for it)."""


def _check_sizes(path: Path, arch: str, header: GGUFHeader) -> None:
    """The model's sizes the config is built from (``embedding_length``, ``block_count``,
    ``feed_forward_length``, the head counts, ``context_length``) agree with the tensors'
    shapes and are in bounds: the engine allocates what they say before it reads a tensor."""
    shapes = {t.name: t.shape for t in header.tensors}

    def bad(key: str, value, why: str) -> ModelFileError:
        return ModelFileError(f"GGUF file {str(path)!r}: {arch}.{key}={value!r}, but {why}")

    def get(key: str):
        value = header.fields.get(f"{arch}.{key}")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad(key, value, "it is not an integer")
        return value

    embd = shapes.get("token_embd.weight")
    hidden = get("embedding_length")
    if embd is None or len(embd) != 2:
        raise ModelFileError(f"GGUF file {str(path)!r}: it has no 2-D token_embd.weight")
    if hidden != embd[0]:
        raise bad("embedding_length", hidden, f"token_embd.weight has rows of {embd[0]}")
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.")
              and n.split(".")[1].isdigit()}  # fmt: skip
    layers = get("block_count")
    if layers is None or len(blocks) != layers or max(blocks, default=-1) != layers - 1:
        raise bad("block_count", layers, f"the file has tensors of {len(blocks)} blocks "
                                         f"(blk.0 to blk.{max(blocks, default=0)})")
    heads, kv_heads = get("attention.head_count"), get("attention.head_count_kv")
    for key, n in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if n is not None and not 1 <= n <= hidden:
            raise bad(key, n, f"a count of heads is 1 to embedding_length ({hidden})")
    if heads is None:
        raise bad("attention.head_count", heads, "the file must give it")
    ffn, up = get("feed_forward_length"), shapes.get("blk.0.ffn_up.weight")
    if not arch.endswith("moe") and up is not None and len(up) == 2 and ffn != up[1]:
        raise bad("feed_forward_length", ffn, f"blk.0.ffn_up.weight has {up[1]} rows")
    ctx = get("context_length")
    if ctx is not None and not 1 <= ctx <= MAX_CONTEXT_LENGTH:
        raise bad("context_length", ctx, f"the limit is {MAX_CONTEXT_LENGTH}")


def config_overrides(path: Path) -> dict:
    """The config settings of a Gemma 2/3 file that transformers' GGUF reader leaves at its
    defaults (empty for other architectures):

    * ``query_pre_attn_scalar``: from ``attention.scale`` when the file has it, else
      llama.cpp's rule (the 27B models: ``hidden_size / num_heads``; others: ``head_dim``);
    * the soft-capping of scores and logits (``attn_logit_softcapping``,
      ``final_logit_softcapping``; Gemma 3 has none);
    * ``layer_types`` from ``attention.sliding_window_pattern`` when the file has it;
    * Gemma 3's two RoPEs: ``rope.freq_base`` with ``rope.scaling.type``/``factor`` for the
      full layers, ``rope.freq_base_swa`` (10,000 without it) for the sliding ones.
    """
    f = _fields(path)
    arch = f.get("general.architecture")
    if arch not in _GEMMA_27B_LAYERS:
        return {}

    def get(key: str, default=None):
        return f.get(f"{arch}.{key}", default)

    layers, hidden = int(get("block_count")), int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    out: dict = {}
    scale = get("attention.scale")
    if scale:
        out["query_pre_attn_scalar"] = 1.0 / float(scale) ** 2
    else:
        out["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] \
            else head_dim  # fmt: skip
    # llama.cpp caps Gemma 2's scores and logits (50 and 30 without the keys), not Gemma 3's.
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        out[key] = float(get(key, default)) if arch == "gemma2" else None
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e6))}
        kind = get("rope.scaling.type")
        if kind and kind != "none":
            if kind != "linear":
                raise ValueError(f"GGUF file {str(path)!r}: {arch}.rope.scaling.type={kind!r} "
                                 "is not supported for gemma3 (linear is)")
            full.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
        local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 1e4))}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


DIGIT_SPLIT_PRE_TOKENIZERS = ("smollm", "codeshell", "exaone", "minerva-7b", "mellum2")
"""``tokenizer.ggml.pre`` values whose text llama.cpp splits into single digits before the
GPT-2 pattern (its ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` group; the models' own tokenizers do
the same with a ``Digits`` pre-tokenizer). transformers' GGUF reader builds the GPT-2
pattern alone for them, so a run of spaces before a digit is split differently: in
SmolLM2, ``":  2"`` became `` ``, `` ``, ``2`` instead of ``  ``, ``2``."""


def fix_pre_tokenizer(path: Path, tokenizer) -> bool:
    """Give ``tokenizer`` (a fast tokenizer converted from the GGUF file at ``path``) the
    digit split its file's pre-tokenizer type asks for, where transformers left the plain
    byte-level pattern; True when it changed."""
    from tokenizers import Regex, pre_tokenizers

    if read_header(path).fields.get("tokenizer.ggml.pre") not in DIGIT_SPLIT_PRE_TOKENIZERS:
        return False
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        return False  # transformers built a split of its own
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), backend.pre_tokenizer])
    return True
