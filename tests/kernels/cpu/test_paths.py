"""Which CPU paths the code chooses, asked of the code (never assumed from the host), and
the dtype ``auto`` resolves to on the CPU."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from pagedserve.engine.worker import settings
from pagedserve.kernels import get_attention_backend
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu import paths as cpu_paths
from pagedserve.kernels.cpu.backend import CpuBackend
from pagedserve.kernels.cpu.layer_ops import NativeLayerOps


def test_describe_reports_what_the_backend_runs() -> None:
    info = cpu_paths.describe(get_attention_backend("cpu", "cpu"))
    lib = cpu_native.load()
    isa = cpu_native.isa(lib)
    # The engine's library is the best level the CPU runs, and every op reports it.
    assert info["levels"] == list(cpu_native.runnable_levels())
    assert isa == info["levels"][-1]
    assert info["attention"] == info["layer_ops"] == isa
    if isa == "portable":
        assert not str(info["linear_f32"]).startswith("native")
    else:
        # Every row count on AVX-512 builds; past 256 rows AVX2 builds take oneDNN's.
        assert str(info["linear_f32"]).startswith(
            "native-avx512 (every row count)" if isa == "avx512" else f"native-{isa} (1-256 rows)")
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert info["linear_bf16"] == ("onednn-packed" if onednn_bf16 else "torch")
    feats = cpu_native.cpu_features()
    assert info["native_bf16"] == ("avx512_bf16" in feats or "amx_bf16" in feats or "bf16" in feats)
    assert set(info["features"]) <= feats
    assert info["layers"] == "fused"
    # The fused call takes float32 activations only: bfloat16 steps run op by op.
    backend = get_attention_backend("cpu", "cpu")
    assert cpu_paths.describe(backend, torch.bfloat16)["layers"] == "per-op (bfloat16)"
    unfused = cpu_paths.describe(CpuBackend(lib, NativeLayerOps(lib), fuse_layers=False))
    assert unfused["layers"] == "per-op"
    assert cpu_paths.describe(CpuBackend(lib, NativeLayerOps(lib), fuse_layers=False),
                              torch.bfloat16)["layers"] == "per-op"  # fmt: skip


def test_describe_the_torch_backend() -> None:
    info = cpu_paths.describe(get_attention_backend("torch", "cpu"))
    assert (info["attention"], info["layer_ops"], info["linear_f32"]) == ("torch",) * 3
    assert info["layers"] == "per-op"


def test_summary_line_names_every_choice() -> None:
    info = {"attention": "avx2", "layer_ops": "avx2", "native_bf16": False,
            "linear_f32": "native-avx2 (1-256 rows), onednn-packed above",
            "linear_bf16": "torch", "layers": "fused"}  # fmt: skip
    assert cpu_paths.summary(info, "float32") == (
        "cpu kernels: attention avx2, linear native-avx2 (1-256 rows), onednn-packed above, "
        "layer ops avx2, layers fused; dtype float32 (no native bf16)")
    assert "linear torch" in cpu_paths.summary(info, "bfloat16")


def test_native_bf16_follows_the_cpu_flags() -> None:
    assert cpu_paths.native_bf16(frozenset({"avx512f", "amx_bf16"}))
    assert cpu_paths.native_bf16(frozenset({"avx512f", "avx512_bf16"}))
    assert not cpu_paths.native_bf16(frozenset({"avx2", "fma", "avx512f", "avx512bw"}))


CPU = torch.device("cpu")
HF = types.SimpleNamespace(torch_dtype="bfloat16")


def test_auto_dtype_on_the_cpu() -> None:
    assert settings.resolve_dtype("auto", HF, CPU, cpu_native_bf16=True) == torch.bfloat16
    assert settings.resolve_dtype("auto", HF, CPU, cpu_native_bf16=False) == torch.float32
    assert settings.resolve_dtype("float32", HF, CPU, cpu_native_bf16=True) == torch.float32
    # What this host gets: bfloat16 exactly where its flags say it computes in it.
    want = torch.bfloat16 if cpu_paths.native_bf16() else torch.float32
    assert settings.resolve_dtype("auto", HF, CPU) == want


def test_explicit_bfloat16_without_native_support_warns_once(caplog) -> None:
    settings._warn_slow_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        for _ in range(3):
            assert settings.resolve_dtype("bfloat16", HF, CPU, cpu_native_bf16=False) == torch.bfloat16
        assert settings.resolve_dtype("bfloat16", HF, CPU, cpu_native_bf16=True) == torch.bfloat16
    slow = [r for r in caplog.records if "without native bfloat16" in r.getMessage()]
    assert len(slow) == 1 and "several times slower than float32" in slow[0].getMessage()


@pytest.mark.parametrize("level", cpu_native.runnable_levels())
def test_every_level_builds_its_own_vector_path(level) -> None:
    """Each build level's library runs the path it is named for (the flags select the
    code: a build that fell back to the portable loops would say so)."""
    lib = cpu_native.build_library(level)
    assert cpu_native.isa(lib) == level
    assert bool(lib.gemm_f32_available()) == (level != "portable")
