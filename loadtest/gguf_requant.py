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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REQUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The GGML types that can be asked for (those the ``gguf`` package quantizes)."""
FLOAT_TYPES = ("F32", "F16", "BF16")
"""GGML types copied as they are; a tensor of any other type is re-encoded."""


def requantize(src: Path, dst: Path, target: str) -> int:
    """Write ``src`` to ``dst`` with its quantized tensors in ``target`` (a name of
    :data:`REQUANTIZED`); returns the number of tensors re-encoded."""
    import gguf

    target = target.upper()
    if target not in REQUANTIZED:
        raise ValueError(f"--type {target!r}: expected one of {', '.join(REQUANTIZED)}")
    qtype = gguf.GGMLQuantizationType[target]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        data = t.data
        if t.tensor_type.name not in FLOAT_TYPES and t.tensor_type != qtype:
            data = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), qtype)
            tensors.append((t.name, np.ascontiguousarray(data), qtype, True))
        else:
            tensors.append((t.name, data, t.tensor_type, False))
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
    p.add_argument("--type", default="q8_0", help=f"one of {', '.join(REQUANTIZED)}")
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
