"""The K-quant encoders and the llama-quantize recipes of ``loadtest.gguf_requant``.

The encoders are checked three ways: the ``gguf`` package's dequantizer reads their bytes
back within what 4, 5 and 6 bits allow, special blocks (zero, constant, one sign) come
back as they should, and on a fixed input their bytes hash to those of llama.cpp's
``quantize_row_q{4,5,6}_K_ref``. The recipes are checked on the default model's tensor
list: which type each tensor gets (the 576-wide ones in their fallback types).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from pagedserve.loadtest import kquants
from pagedserve.loadtest.gguf_requant import RECIPES, recipe_type, tensor_types

GGUF = pytest.importorskip("gguf")

NMAX = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 32}
REL_RMS = {"Q4_K": 0.08, "Q5_K": 0.042, "Q6_K": 0.021}
"""Bounds on the round trip's RMS error over the RMS of Gaussian weights (uniform rounding
over a 32-weight sub-block's range gives about 0.081, 0.039 and 0.019)."""
GOLDEN = {
    "Q4_K": "1a95a33431068e82de77348b3df1c7497ed218086bff44567624045b7199cf2a",
    "Q5_K": "4ecaea25950048ad0de7d862179fc7788ebe7b2162ec6d5dc10c2c271669ccdb",
    "Q6_K": "26e3e660f8b6a1ef6b3db67e29d717c8384879565ee64e4d976b59dc84c7a938",
}
"""sha256 of llama.cpp's ``quantize_row_*_K_ref`` bytes for :func:`golden_input`."""


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    return GGUF.quants.dequantize(data, GGUF.GGMLQuantizationType[qtype])


def golden_input() -> np.ndarray:
    """``[24, 256]`` float32 made of integer arithmetic only (the same on any machine):
    near-Gaussian rows at scales 1 to 1/32, then a zero, a constant, an all-positive, an
    all-negative and a one-outlier block."""
    i = np.arange(24 * 256, dtype=np.int64)
    noise = sum(((i * a + b) % 4294967296) >> 16 for a, b in
                ((2654435761, 1), (2246822519, 7), (3266489917, 13)))  # fmt: skip
    x = ((noise - 98302) / 2.0**15).astype(np.float32).reshape(24, 256)
    x /= np.float32(2.0) ** (np.arange(24, dtype=np.float32) % 6)[:, None]
    x[19] = 0
    x[20] = 0.375
    x[21] = np.abs(x[21])
    x[22] = -np.abs(x[22])
    x[23] *= np.float32(1 / 64)
    x[23, 77] = 3
    return x


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_round_trip_through_the_gguf_dequantizer(qtype):
    """Gaussian rows come back with the RMS error of uniform rounding at 4/5/6 bits, no
    weight further than a step of its sub-block's scale, and the shape ``gguf`` gives."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 1536)) * rng.uniform(0.01, 2, (48, 1))).astype(np.float32)
    q = kquants.quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (48, 1536 // 256 * kquants.BLOCK_BYTES[qtype])
    y = dequantize(q, qtype)
    err = y - x
    assert np.sqrt((err**2).mean() / (x**2).mean()) < REL_RMS[qtype]
    for row, e in zip(x, err, strict=True):  # relative to each row's scale
        assert np.sqrt((e**2).mean() / (row**2).mean()) < REL_RMS[qtype] * 1.25
    if qtype == "Q6_K":  # symmetric: a step is amax / 32
        xs, es = x.reshape(-1, 16), np.abs(err).reshape(-1, 16)
        assert (es.max(axis=1) <= np.abs(xs).max(axis=1) / 32).all()
    else:  # offset: a step is (max - min(min, 0)) / nmax
        xs, es = x.reshape(-1, 32), np.abs(err).reshape(-1, 32)
        span = xs.max(axis=1) - np.minimum(xs.min(axis=1), 0)
        assert (es.max(axis=1) <= 1.5 * span / NMAX[qtype]).all()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_special_blocks(qtype):
    """A zero block comes back as zeros, a constant one to a float16's precision, and
    blocks of one sign keep it, within a step of their sub-blocks' scales."""
    x = np.zeros((4, 256), np.float32)
    x[1] = 0.375
    x[2] = np.linspace(0.5, 2, 256)
    x[3] = -np.linspace(0.5, 2, 256)
    y = dequantize(kquants.quantize(x, qtype), qtype)
    assert (y[0] == 0).all()
    np.testing.assert_allclose(y[1], x[1], rtol=2e-3)
    assert (y[2] > 0).all() and (y[3] < 0).all()
    assert np.abs(y[2:] - x[2:]).max() < 1.5 * 2 / NMAX[qtype]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_llama_cpps_bytes(qtype):
    """Byte for byte what llama.cpp's reference encoder writes for :func:`golden_input`."""
    got = kquants.quantize(golden_input(), qtype)
    assert hashlib.sha256(got.tobytes()).hexdigest() == GOLDEN[qtype]


def test_k_quants_refuse_partial_blocks_and_other_types():
    with pytest.raises(ValueError, match="256"):
        kquants.quantize(np.zeros((2, 576), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="Q3_K"):
        kquants.quantize(np.zeros((2, 256), np.float32), "Q3_K")


@pytest.fixture(scope="module")
def default_reader():
    from pagedserve.engine.loader import default_gguf_path

    return GGUF.GGUFReader(str(default_gguf_path()))


MORE_BITS_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
"""llama.cpp's "more bits" layers of a 30-layer model (first and last eighth: 3 and 4
layers; every third from layer 5)."""

COUNTS = {
    "q4_k_m": {None: 61, "Q8_0": 15, "Q6_K": 14, "Q4_K": 16, "Q5_0": 166},
    "q5_k_m": {None: 61, "Q8_0": 15, "Q6_K": 14, "Q5_K": 16, "Q5_1": 166},
    "q6_k": {None: 61, "Q8_0": 181, "Q6_K": 30},
}
"""Tensors of the default model per type under each recipe (None: kept, the norms)."""


@pytest.mark.parametrize("recipe", ["q4_k_m", "q5_k_m", "q6_k"])
def test_recipe_types_of_the_default_model(recipe, default_reader):
    """Each tensor of the default model (30 layers, 576 wide, 1536 FFN, tied embedding)
    and the type each recipe gives it: only ``ffn_down`` (1536-wide rows) holds whole
    256-weight blocks; every other weight takes its K-quant's fallback."""
    types = tensor_types(default_reader, recipe)
    assert len(types) == 272
    k, fallback = {"q4_k_m": ("Q4_K", "Q5_0"), "q5_k_m": ("Q5_K", "Q5_1"),
                   "q6_k": ("Q6_K", "Q8_0")}[recipe]  # fmt: skip
    for name, kind in types.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        more = recipe != "q6_k" and layer in MORE_BITS_30
        if name.endswith("_norm.weight"):
            want = None
        elif name == "token_embd.weight":
            want = "Q8_0"  # tied: the output's Q6_K, 576 wide: Q8_0
        elif name.endswith("ffn_down.weight"):
            want = "Q6_K" if more else k
        elif name.endswith("attn_v.weight"):
            want = "Q8_0" if more else fallback
        else:
            want = fallback
        assert kind == want, name
    counts = {kind: sum(1 for v in types.values() if v == kind) for kind in set(types.values())}
    assert counts == COUNTS[recipe]


def test_recipe_types_where_rows_are_whole_blocks():
    """The rules on a model whose rows are whole K-quant blocks (2048 wide, 32 layers,
    untied output): the output in Q6_K, the embedding in the recipe's type, ``attn_v`` and
    ``ffn_down`` in Q6_K in the first 4, the last 4 and every third layer between, a
    fused ``attn_qkv`` one step up; 1-D tensors and biases kept."""
    more = [layer for layer in range(32) if recipe_type("Q4_K_M", f"blk.{layer}.attn_v.weight",
                                                         2048, 32, False) == "Q6_K"]  # fmt: skip
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for recipe, k in zip(RECIPES, ("Q4_K", "Q5_K", "Q6_K"), strict=True):
        assert recipe_type(recipe, "output.weight", 2048, 32, False) == "Q6_K"
        assert recipe_type(recipe, "token_embd.weight", 2048, 32, False) == k
        assert recipe_type(recipe, "token_embd.weight", 2048, 32, True) == "Q6_K"
        assert recipe_type(recipe, "blk.4.ffn_down.weight", 5632, 32, False) == k
        assert recipe_type(recipe, "blk.4.attn_q.weight", 2048, 32, False) == k
        assert recipe_type(recipe, "blk.0.attn_q.bias", 2048, 32, False) is None
        assert recipe_type(recipe, "blk.0.ffn_norm.weight", 2048, 32, False) is None
    assert recipe_type("Q4_K_M", "blk.4.attn_qkv.weight", 2048, 32, False) == "Q5_K"
    assert recipe_type("Q5_K_M", "blk.4.attn_qkv.weight", 2048, 32, False) == "Q6_K"
    assert recipe_type("Q5_K_M", "blk.0.ffn_down.weight", 5632, 32, False) == "Q6_K"
    assert recipe_type("Q6_K", "blk.0.attn_v.weight", 2048, 32, False) == "Q6_K"
    assert recipe_type("Q5_K_M", "blk.0.attn_v.weight", 576, 32, False) == "Q8_0"
    assert recipe_type("Q5_K_M", "blk.4.attn_v.weight", 576, 32, False) == "Q5_1"


def test_unknown_type_is_refused(default_reader):
    with pytest.raises(ValueError, match="q4_k_m"):
        tensor_types(default_reader, "q3_k_m")
