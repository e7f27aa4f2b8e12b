"""The Triton RoPE kernel (alone and fused with the K/V write) against the torch layer
ops, and the launches it saves in one eager layer step.

Without CUDA the kernels run in the Triton interpreter, which must be on before triton
is first imported (see :mod:`tests.kernels.triton.test_kernels`): if triton was already
imported compiled in this process, the module re-runs itself in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INTERPRET_SET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
RUN_IN_SUBPROCESS = DEVICE == "cpu" and "triton" in sys.modules and not _INTERPRET_SET
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from pagedserve.kernels import KernelSettings, get_attention_backend, torch_ref  # noqa: E402
from pagedserve.kernels.cpu.synthetic import make_step  # noqa: E402
from pagedserve.kernels.layer_ops import TorchLayerOps  # noqa: E402
from pagedserve.kernels.triton.backend import TritonLayerOps  # noqa: E402
from tests.helpers.kernels import fused_qkv_views  # noqa: E402
from tests.helpers.triton_keys import triton_kernels  # noqa: E402

# The interpreter rounds float32 to bfloat16 by truncation (compiled code, like torch,
# rounds to nearest): a bfloat16 result may differ from torch's by one unit of each
# rounded product (inputs of up to ~4 here: products' units up to 2^-6).
EXACT = {torch.float32: dict(atol=1e-6, rtol=1e-6),
         torch.bfloat16: dict(atol=2**-5, rtol=2**-7)}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
ROPE_VARIANTS = {
    "default": dict(rope_theta=10000.0),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                    "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                    "factor": 4.0}),
}  # fmt: skip


def test_in_subprocess() -> None:
    """Run this module where triton is first imported with the interpreter on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def _cos_sin(variant: str, head_dim: int, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin ``[T, 1, D]`` rows as the model gathers them from its float32 tables."""
    from pagedserve.engine.models.rope import rope_tables

    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                   max_position_embeddings=512, **ROPE_VARIANTS[variant])  # fmt: skip
    cos, sin = rope_tables(cfg, head_dim, 512)
    return tuple(t[positions].to(dtype).unsqueeze(1).to(DEVICE) for t in (cos, sin))


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [((4, 4), 64), ((8, 2), 128), ((7, 1), 80)])
def test_rope_matches_the_torch_layer_ops(variant, dtype, heads, head_dim) -> None:
    """Rotate-half RoPE of strided q/k views (a fused QKV output), GQA groups 1/4/7, in
    place, equal to the torch reference's products rounded to the dtype then summed."""
    gen = torch.Generator().manual_seed(1)
    t = 9
    positions = torch.tensor([0, 1, 5, 63, 64, 65, 200, 400, 511])
    cos, sin = _cos_sin(variant, head_dim, positions, dtype)
    qkv = torch.randn(t, (heads[0] + 2 * heads[1]) * head_dim, generator=gen).to(dtype)
    qkv = qkv.to(DEVICE)
    q = qkv[:, : heads[0] * head_dim].view(t, heads[0], head_dim)
    k = qkv[:, heads[0] * head_dim : (heads[0] + heads[1]) * head_dim].view(t, heads[1], head_dim)
    want_q, want_k = TorchLayerOps().rope(q, k, cos, sin)
    got_q, got_k = TritonLayerOps().rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **EXACT[dtype])
    torch.testing.assert_close(got_k, want_k, **EXACT[dtype])


def _backend():
    return get_attention_backend("triton", DEVICE, KernelSettings(triton_interpret=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)])
def test_rope_forward_writes_the_rotated_key_and_attends(dtype, heads) -> None:
    """``rope_forward`` (RoPE fused with the K/V write) gives what torch RoPE and then
    the backend's ``forward`` give: the same cache rows (padding slots untouched), the
    same attention output, q rotated in place and the key views left as they were."""
    seq_lens, q_lens = [3, 40, 17, 9], [1, 1, 17, 5]
    step = make_step(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                     block_size=16, dtype=dtype, device=DEVICE, num_pad_tokens=2)  # fmt: skip
    m = step.meta
    positions = torch.tensor([s - q + i for s, q in zip(seq_lens, q_lens, strict=True)
                              for i in range(q)] + [0, 0])  # fmt: skip
    cos, sin = _cos_sin("llama3", 64, positions, dtype)
    q, k, v = fused_qkv_views(step)
    key_before = k.clone()
    ref_q, ref_k = TorchLayerOps().rope(q, k, cos, sin)
    ref_kc, ref_vc = step.k_cache.clone(), step.v_cache.clone()
    torch_ref.write_kv(ref_k, v, ref_kc, ref_vc, m.slot_mapping)
    backend = _backend()
    backend.prepare(m, step.block_size)
    expected = backend.forward(ref_q, ref_k, v.contiguous(), ref_kc.clone(), ref_vc.clone(), m,
                               step.scale)  # fmt: skip
    out = backend.rope_forward(q, k, v, cos, sin, step.k_cache, step.v_cache, m, step.scale)
    # NaN where no slot was written: equal_nan checks the padding rows stayed unwritten.
    torch.testing.assert_close(step.k_cache, ref_kc, equal_nan=True, **EXACT[dtype])
    torch.testing.assert_close(step.v_cache, ref_vc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(q, ref_q, **EXACT[dtype])
    torch.testing.assert_close(k, key_before, atol=0, rtol=0)
    n = m.query_start_loc_cpu[-1]
    torch.testing.assert_close(out[:n], expected[:n], **TOL[dtype])


class _CountLaunches(TorchDispatchMode):
    """Counts the torch ops that run a kernel (views and ``empty`` allocations launch
    nothing) and the Triton launches (not the torch ops the interpreter runs inside one)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self._in_triton = False
        for kernel in triton_kernels():
            self._wrap(kernel)

    def _wrap(self, kernel) -> None:
        run = kernel.run

        def counted_run(*args, **kwargs):
            if self._in_triton:
                return run(*args, **kwargs)
            self.launches.append(kernel.fn.__name__)
            self._in_triton = True
            try:
                return run(*args, **kwargs)
            finally:
                self._in_triton = False

        kernel.run = counted_run
        self._restore = getattr(self, "_restore", []) + [(kernel, run)]

    def __exit__(self, *exc):
        for kernel, run in self._restore:
            kernel.run = run
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not self._in_triton and not func.__name__.startswith("empty"):
            self.launches.append(str(func))
        return func(*args, **(kwargs or {}))


class _TorchOpsUnfused:
    """The Triton backend with the torch layer ops and without ``rope_forward`` (torch
    RoPE, then ``forward``)."""

    def __init__(self, backend) -> None:
        self.name, self.ops, self._b = backend.name, TorchLayerOps(), backend

    def prepare(self, meta, block_size):
        self._b.prepare(meta, block_size)

    def forward(self, *args):
        return self._b.forward(*args)


def test_fused_rope_drops_the_launches_of_an_eager_layer_step() -> None:
    """One decoder layer over a mixed step: torch ops plus Triton launches, with torch
    RoPE, a contiguous value and a separate K/V write, then with the fused kernel; the
    layer's output is the same. The norms are the fused Triton ones: the registry pairs
    the Triton backend with the Triton layer ops."""
    from pagedserve.engine.models.decoder import DecoderLayer, DecoderSpec

    spec = DecoderSpec(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                       tie_word_embeddings=False, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    layer = DecoderLayer(spec).to(DEVICE)
    step = make_step([5, 12], [1, 6], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                     device=DEVICE)  # fmt: skip
    positions = torch.tensor([4] + list(range(6, 12)))
    cos, sin = _cos_sin("default", 16, positions, torch.float32)
    hidden = torch.randn(7, 64, device=DEVICE)
    results = {}
    assert _backend().ops.name == "triton"
    for name, attn in (("torch ops", _TorchOpsUnfused(_backend())), ("fused", _backend())):
        k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
        attn.prepare(step.meta, step.block_size)
        residual = hidden.clone()
        with torch.no_grad(), _CountLaunches() as counted:
            out, _ = layer(hidden, residual, cos, sin, k_cache, v_cache, step.meta, attn)
        results[name] = (counted.launches, out, k_cache)
    before, after = results["torch ops"][0], results["fused"][0]
    # Two norms of 7 torch ops each -> 1 launch each; RoPE (5 torch ops per tensor, q and
    # k), the contiguous value and the K/V write -> 1 launch.
    assert after.count("_rms_norm_kernel") == 2, after  # the registry's Triton layer ops
    assert after.count("_rope_kernel") == 1 and "_write_kv_kernel" not in after, after
    assert len(before) - len(after) == 2 * 6 + 11, (before, after)
    torch.testing.assert_close(results["fused"][1], results["torch ops"][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["fused"][2], results["torch ops"][2], atol=1e-6,
                               rtol=1e-6, equal_nan=True)  # fmt: skip
