"""The engine's settings, resolved once, before the worker exists.

:func:`resolve_settings` settles every ``"auto"`` and ``None`` of an
:class:`~pagedserve.engine.config.EngineConfig` against the model's files and the device:
where the model lives, its configuration and shapes, the device, the quantization (the
user's, or the checkpoint's own), the compute dtype, the context length and the step's
token budget. The result, :class:`EngineSettings`, is what every part reads: the worker
builds from it, the engine loop hands its values to the scheduler and the input limits.
The one number the worker reports back is how many KV blocks its memory holds (it is
measured on the device once the model is loaded).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.engine import envs
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.loader import is_gguf_file, load_config, resolve_model_path
from pagedserve.engine.loader.checkpoint_quant import read_quantization_config, resolve_quantization
from pagedserve.engine.loader.gguf_weights import tensor_formats
from pagedserve.engine.models import DecoderSpec
from pagedserve.engine.models.spec import max_positions, position_limit
from pagedserve.kernels.cpu import paths as cpu_paths
from pagedserve.kernels.cpu.native import cpu_features as cpu_features_now
from pagedserve.kernels.cpu.native import engine_level

logger = logging.getLogger("pagedserve.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineSettings:
    """An :class:`EngineConfig` resolved against the model and the device."""

    config: EngineConfig
    """The settings as given."""
    model_path: Path
    """The local model folder (a GGUF file's or the default model's converted folder)."""
    model_name: str
    hf_config: Any
    """The model's transformers configuration."""
    decoder: DecoderSpec
    """The whole model's shapes (a tensor-parallel rank holds a part of them)."""
    device: torch.device
    quant_config: dict | None
    """The checkpoint's own ``quantization_config`` (GPTQ, AWQ), if any."""
    quantization: str | None
    """``config.quantization``, or the checkpoint's own."""
    dtype: torch.dtype
    """The compute dtype (float32 for quantized weights)."""
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def block_size(self) -> int:
        return self.config.block_size


def resolve_settings(config: EngineConfig) -> EngineSettings:
    """``config`` resolved against its model's files and the device; a setting the model
    or the device cannot meet is a ``ValueError`` that names it."""
    device = resolve_device(config.device)
    as_given = config
    if gguf_by_default(config, device):
        config = dataclasses.replace(config, quantization="gguf")
    # A GGUF file served in its own blocks is read by the loader itself: its folder holds
    # only the header's config and tokenizer.
    model_path = resolve_model_path(config.model, config.revision,
                                    weights=config.quantization != "gguf")  # fmt: skip
    hf_config = load_config(model_path)
    decoder = DecoderSpec.from_hf(hf_config)
    if config is not as_given and (decoder.moe is not None  # experts: expanded, as before
                                   or not tensor_formats(Path(config.model).expanduser())):
        config = as_given  # (and a file with no kept-quantized tensor: F16, Q2_K, ...)
        model_path = resolve_model_path(config.model, config.revision)
        hf_config = load_config(model_path)
        decoder = DecoderSpec.from_hf(hf_config)
    elif config is not as_given:
        logger.info("serving the GGUF file's weights in their own blocks (quantization='gguf', "
                    "the default for a GGUF file on the CPU; a dtype expands them)")
    quant_config = read_quantization_config(hf_config, model_path)
    model_name = config.model or model_path.name
    quantization = resolve_quantization(config, quant_config, model_name)
    check_moe(decoder, quantization, gguf_file=config.model is not None and is_gguf_file(config.model))
    dtype = torch.float32 if quantization else resolve_dtype(config.dtype, hf_config, device)
    max_model_len = resolve_max_model_len(config, hf_config)
    return EngineSettings(
        config=as_given, model_path=model_path, model_name=model_name, hf_config=hf_config,
        decoder=decoder, device=device, quant_config=quant_config, quantization=quantization,
        dtype=dtype, max_model_len=max_model_len,
        max_num_batched_tokens=resolve_max_num_batched_tokens(config, max_model_len))  # fmt: skip


def gguf_by_default(config: EngineConfig, device: torch.device, cpu_level: str | None = None,
                    cpu_native_bf16: bool | None = None,
                    cpu_features: frozenset[str] | None = None) -> bool:
    """Whether a GGUF file may be served in its own blocks without asking: a ``.gguf``
    path with no ``quantization`` and no ``dtype`` given, on one rank, on a CPU whose
    native build has the 8-bit-activation products (AVX2, AVX-512). Where the CPU computes
    in float32 (no native bfloat16) the quantized linears measured faster than float32
    ones at batch 1-64 (``BENCHMARKS.md`` B14 on an AVX2 Zen 3, A16 on an AVX-512 Zen 5),
    in a fifth to a quarter of the memory. Where it computes in bfloat16, the default
    needs an AVX-512 build with AVX-512 VNNI (the products' 512-bit dots) and no AMX:
    there they measured faster than the bfloat16 expansion at batch 1-64 (A16, Zen 5);
    against AMX's bfloat16 tiles they were not measured. With float activations (the
    portable build) they are slower from 32 rows. A ``dtype`` asks for the weights
    expanded to it. :func:`resolve_settings` then expands a model with experts
    (``check_moe``) and a file with no kept-quantized tensor all the same.
    ``cpu_level``, ``cpu_native_bf16`` and ``cpu_features`` override this CPU's answers
    (tests)."""
    if not (config.quantization is None and config.model is not None
            and is_gguf_file(config.model) and config.dtype == "auto" and device.type == "cpu"
            and config.tensor_parallel_size == 1):
        return False
    level = engine_level(envs.cpu_isa()) if cpu_level is None else cpu_level
    bf16 = cpu_paths.native_bf16() if cpu_native_bf16 is None else cpu_native_bf16
    if level == "portable":
        return False
    if not bf16:
        return True
    feats = cpu_features_now() if cpu_features is None else cpu_features
    return level == "avx512" and "avx512_vnni" in feats and "amx_bf16" not in feats


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(name)


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """``max_model_len``, or the most positions the model serves (its RoPE table, or where
    longrope's long factors would begin); more than that is refused."""
    hf_max, why = position_limit(hf_config)
    if config.max_model_len is not None and config.max_model_len > hf_max:
        raise ValueError(f"max_model_len={config.max_model_len} is larger than the model's {why}")
    if hf_max < max_positions(hf_config):
        logger.info("max_model_len at most %d: the model's %s", hf_max, why)
    return config.max_model_len or hf_max


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The step's token budget: as given; 2048 with chunked prefill; without it, room for
    a whole prompt of ``max_model_len`` tokens."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if config.enable_chunked_prefill:
        return 2048
    return max(max_model_len, 2048)


def resolve_dtype(name: str, hf_config, device: torch.device,
                  cpu_native_bf16: bool | None = None) -> torch.dtype:
    """``auto``: the checkpoint's 16-bit dtype (else bfloat16) on CUDA; on the CPU,
    bfloat16 where the CPU computes in it natively (AVX512-BF16, AMX), else float32.
    ``cpu_native_bf16`` overrides the CPU's own answer (tests)."""
    if device.type == "cpu":
        native = cpu_paths.native_bf16() if cpu_native_bf16 is None else cpu_native_bf16
        if name == "auto":
            return torch.bfloat16 if native else torch.float32
        if name == "bfloat16" and not native:
            _warn_slow_bf16()
    if name != "auto":
        return DTYPES[name]
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV cache's element type: ``auto`` is the model's dtype. The triton kernels
    take their cache in the model's dtype only; an int8 cache (codes and a scale per
    row, ``pagedserve.kernels.interface``) is the CPU backends' (native and torch)."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        if backend == "triton":
            raise ValueError(
                "kv_cache_dtype='int8' is a CPU cache: the triton attention backend takes "
                "its KV cache in the model's dtype (use kv_cache_dtype='auto')")
        return torch.int8
    dtype = DTYPES[name]
    if dtype != model_dtype and backend == "triton":
        raise ValueError(
            f"kv_cache_dtype={name!r} differs from the model dtype "
            f"{str(model_dtype).removeprefix('torch.')}: the triton attention backend takes "
            "its KV cache in the model's dtype (use kv_cache_dtype='auto')")
    return dtype


@functools.cache
def _warn_slow_bf16() -> None:
    logger.warning(
        "dtype bfloat16 on a CPU without native bfloat16 arithmetic (no AVX512-BF16 or "
        "AMX-BF16): every matrix product widens to float32 and rounds back, so prefill "
        "and batched decode run several times slower than float32 (dtype='auto' picks "
        "float32 here)")


def check_moe(spec: DecoderSpec, quantization: str | None, gguf_file: bool = False) -> None:
    """Refuse what a model with experts cannot run: GGUF files (an adapter of its
    experts is refused when the adapter is checked: ``pagedserve.engine.lora.request``); and what a
    model with fused checkpoint projections (Phi-3) cannot: quantized checkpoints and GGUF
    files (``gguf_file``: ``model`` names one; its converted config would lack the
    model's longrope factors and sliding window)."""
    if spec.fused_checkpoint and (gguf_file or quantization in ("gguf", "gptq", "awq")):
        what = "a GGUF file" if gguf_file else f"quantization={quantization!r}"
        raise ValueError(
            f"{what} is not supported for Phi-3 models (their checkpoints fuse qkv_proj and "
            "gate_up_proj): serve the float checkpoint (quantization='int8' keeps its "
            "linears in int8)")
    if spec.moe is None:
        return
    if quantization == "gguf":
        raise ValueError(
            "quantization='gguf' is not supported for mixture-of-experts models: serve the "
            "float checkpoint (quantization='int8' keeps the experts' weights in int8) or a "
            "GPTQ or AWQ one")
