"""A GGUF file re-quantized to another block format, for benchmarks and tests.

``python -m pagedserve.loadtest.gguf_requant IN.gguf OUT.gguf --type q8_0`` copies every metadata
field and tensor of ``IN`` and re-encodes its quantized weights (any GGML type the
``gguf`` package dequantizes: Q4_1, the K-quants, ...) in ``--type`` (one the package
quantizes: ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``); float tensors (norms) are
copied as they are. The weights go through float32 on the way (the ``gguf`` package's
dequantizer and quantizer), so a Q8_0 file made from the default model's Q4_1 one holds
those 4-bit values at 8 bits: the same model as closely as Q8_0 can hold it, with Q8_0's
bytes and kernels. That is the file to compare formats with (pagedserve and llama.cpp
both serve it) when no Q8_0 release of the model is at hand.

``--type`` is also one of llama-quantize's K-quant recipes, ``q4_k_m``, ``q5_k_m`` or
``q6_k`` (encoded by :mod:`.kquants`, byte for byte as llama.cpp does), which re-encode
every 2-D weight but the norms: Q4_K (Q5_K; Q6_K), except ``attn_v`` and ``ffn_down`` in
llama.cpp's "more bits" layers (the first and last eighth and every third between) and
the tied ``token_embd``/``output``, which get Q6_K. As in llama.cpp, a tensor whose rows
are not whole 256-weight blocks (the default model's 576-wide ones) falls back to Q5_0 for
Q4_K, Q5_1 for Q5_K and Q8_0 for Q6_K (and a tied embedding to Q8_0). Every output's
``general.file_type`` is llama.cpp's value for its type or recipe.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

REQUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The single GGML types that can be asked for (those the ``gguf`` package quantizes)."""
RECIPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
"""The llama-quantize recipes that can be asked for (see the module docstring)."""
FLOAT_TYPES = ("F32", "F16", "BF16")
"""GGML types copied as they are by a single type; a tensor of any other type is re-encoded."""
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
              "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}  # fmt: skip
"""llama.cpp's ``general.file_type`` (``llama_ftype``) of each output."""
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""llama.cpp's type for a tensor whose rows are not whole 256-weight K-quant blocks."""
_K_QUANTS = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K"}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose ``attn_v`` and ``ffn_down`` a
    ``_M`` recipe gives Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def recipe_type(recipe: str, name: str, cols: int, n_layers: int, tied: bool) -> str | None:
    """The GGML type ``recipe`` gives the tensor ``name`` (rows of ``cols`` weights, in a
    model of ``n_layers`` layers, ``tied`` when it has no ``output.weight``); None for a
    tensor kept as it is (norms, biases)."""
    if not name.endswith("weight") or "_norm.weight" in name:
        return None
    kind = _K_QUANTS[recipe]
    layer = re.match(r"blk\.(\d+)\.", name)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q8_0" if cols % 256 else "Q6_K"
    if "attn_qkv.weight" in name and recipe != "Q6_K":
        kind = {"Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}[recipe]
    elif ("attn_v.weight" in name or "ffn_down" in name) and recipe != "Q6_K" and layer:
        if more_bits(int(layer.group(1)), n_layers):
            kind = "Q6_K"
    return FALLBACK[kind] if cols % 256 else kind


def tensor_types(reader, target: str) -> dict[str, str | None]:
    """Each tensor of ``reader`` (a ``gguf.GGUFReader``) and the GGML type ``target`` (a
    name of :data:`REQUANTIZED` or :data:`RECIPES`) writes it in; None for one copied as it
    is."""
    target = target.upper()
    if target in REQUANTIZED:
        return {t.name: None if t.tensor_type.name in FLOAT_TYPES else target
                for t in reader.tensors}  # fmt: skip
    if target not in RECIPES:
        choices = ", ".join(name.lower() for name in REQUANTIZED + RECIPES)
        raise ValueError(f"--type {target.lower()!r}: expected one of {choices}")
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    tied = all(t.name != "output.weight" for t in reader.tensors)
    return {t.name: None if len(t.shape) < 2 else
            recipe_type(target, t.name, int(t.shape[0]), n_layers, tied)
            for t in reader.tensors}  # fmt: skip


def requantize(src: Path, dst: Path, target: str) -> int:
    """Write ``src`` to ``dst`` with its weights in ``target`` (a name of
    :data:`REQUANTIZED` or :data:`RECIPES`, either case); returns the number of tensors
    re-encoded."""
    import gguf

    from pagedserve.loadtest import kquants

    target = target.upper()
    reader = gguf.GGUFReader(str(src))
    types = tensor_types(reader, target)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == "general.file_type":
            writer.add_file_type(FILE_TYPES[target])
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(FILE_TYPES[target])
    tensors = []
    for t in reader.tensors:
        kind = types[t.name]
        if kind is None or t.tensor_type.name == kind:
            tensors.append((t.name, t.data, t.tensor_type, False))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
        if kind in kquants.BLOCK_BYTES:
            data = kquants.quantize(weights, kind)
        else:
            data = gguf.quants.quantize(weights, qtype)
        tensors.append((t.name, np.ascontiguousarray(data), qtype, True))
    for name, data, kind, _ in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return sum(1 for *_, changed in tensors if changed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.loadtest.gguf_requant",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("src", type=Path, help="the GGUF file to read")
    p.add_argument("dst", type=Path, help="the GGUF file to write")
    p.add_argument("--type", default="q8_0",
                   help=f"one of {', '.join(n.lower() for n in REQUANTIZED + RECIPES)}")  # fmt: skip
    args = p.parse_args(argv)
    if not args.src.is_file():
        p.error(f"src: {args.src} is not a file")
    try:
        n = requantize(args.src, args.dst, args.type)
    except ValueError as exc:
        p.error(str(exc))
    print(f"{args.dst}: {n} tensors re-encoded as {args.type.upper()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
