"""Engine configuration: one frozen dataclass.

CLI flags and ``LLM(**kwargs)`` map onto these fields by name; an unknown name is an
error. Fields whose default depends on the model or the device (``max_model_len``,
``dtype``, ``max_num_batched_tokens``, the KV cache size) keep ``None``/``"auto"`` here;
the worker resolves them once the model's config and the device are known.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.engine.speculative import SpeculativeConfig
from pagedserve.kernels.registry import BACKENDS as ATTENTION_BACKENDS

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
DEVICES = ("auto", "cpu", "cuda")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "llguidance")
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATIONS = ("gguf", "int8", "gptq", "awq")
QUANTIZED_ACTIVATIONS = ("auto", "int8", "float")


@dataclass(frozen=True)
class EngineConfig:
    # Model
    model: str | None = None
    """Local HF folder, hub id, or None for the embedded default model."""
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    """auto = checkpoint dtype on CUDA; on the CPU bfloat16 where it computes in bfloat16
    natively (AVX512-BF16, AMX-BF16), float32 elsewhere."""
    quantization: str | None = None
    """Weight-only quantized linears: gguf (the weights of a GGUF file as it stores them:
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; the embedded default model's own file
    when no model is given) or
    int8 (per-output-row int8 made at load from a float checkpoint), gptq or awq (a GPTQ
    or AWQ checkpoint's 4- or 8-bit weights; None serves such a checkpoint so too, as its
    config.json says). None with a .gguf path is gguf too with dtype auto, on one rank, on
    a CPU with the 8-bit-activation products (AVX2, AVX-512) and no native bfloat16, for a
    file with kept-quantized tensors and no experts; a dtype given expands the file's
    weights to it."""
    quantized_activations: str = "auto"
    """How the CPU's quantized linears take their activations: int8 (each row quantized
    to 8 bits per 32 elements, integer dot products; weights in the GGUF block formats:
    GGUF files, GPTQ and AWQ checkpoints; per-row int8 weights keep float32), float (float32 products, greedy output as the
    dequantized weights give it) or auto (int8 on the AVX2 and AVX-512 builds, where it
    measured faster; float on the portable one). The start-up paths line says which."""
    max_model_len: int | None = None
    seed: int = 0
    # KV cache
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None
    """Explicit KV cache size. Default on the CPU: 1 GiB; on CUDA: profiled."""
    kv_cache_dtype: str = "auto"
    """Element type of the KV cache: auto (the model's dtype), float32, bfloat16 or
    float16. A 16-bit cache under a float32 model holds twice the tokens in the same
    memory and halves what a long context's decode reads; keys and values are rounded
    to it as they are written (the CPU backends; on CUDA the cache is the model's dtype)."""
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # KV block store (below the prefix cache)
    kv_host_gb: float | None = None
    """A host-memory tier of this many GiB for KV blocks the pool evicts; a prompt whose
    prefix is there is read back instead of computed (CPU and CUDA alike)."""
    kv_store_dir: str | None = None
    """A folder for a disk tier of KV blocks (with kv_store_gb): kept across restarts and
    shareable between processes; blocks of another model or configuration are never
    used."""
    kv_store_gb: float | None = None
    """The disk tier's size in GiB (with kv_store_dir)."""
    kv_store_write_through: bool = False
    """Store every full block as soon as it is computed, not only when the pool evicts
    it (more copies; the store holds a prefix even while the pool does)."""
    # Scheduler
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    """fcfs: requests in arrival order; priority: by each request's ``priority`` (lower
    first, then arrival), and a waiting request preempts running ones of lower priority
    when it has no seat or blocks."""
    # Execution
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    speculative_config: SpeculativeConfig | dict | str | None = None
    """N-gram speculative decoding (:class:`pagedserve.engine.speculative.SpeculativeConfig`; a dict
    or a JSON string of its fields is converted); None = off."""
    structured_outputs_backend: str = "auto"
    """Grammar backend of structured outputs: xgrammar or llguidance (the
    ``structured`` extra installs both)."""
    # LoRA adapters
    enable_lora: bool = False
    """Serve requests with a ``LoRARequest`` (PEFT LoRA adapters of the base model)."""
    max_loras: int = 1
    """Distinct adapters in one step; requests of further adapters wait for a place."""
    max_lora_rank: int = 16
    """The largest ``r`` of an adapter that is accepted."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded (least recently used first out); default ``max(max_loras,
    8)``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        def bad(name: str, value: Any, limit: str) -> ValueError:
            return ValueError(f"{name}={value!r} is invalid: {limit}")

        # Types first, so the range checks below compare numbers with numbers.
        for name in ("max_model_len", "seed", "block_size", "num_gpu_blocks_override",
                     "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "max_loras", "max_lora_rank", "max_cpu_loras"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise bad(name, v, "must be an integer")
        for name in ("gpu_memory_utilization", "kv_cache_memory_gb", "kv_host_gb", "kv_store_gb"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                  or not math.isfinite(v)):
                raise bad(name, v, "must be a finite number")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                     "enable_lora", "kv_store_write_through"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "must be True or False")
        if self.dtype not in DTYPES:
            raise bad("dtype", self.dtype, f"must be one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fp8 = " (fp8 KV caches are not supported)" if str(self.kv_cache_dtype).startswith(
                "fp8") else ""
            raise bad("kv_cache_dtype", self.kv_cache_dtype,
                      f"must be one of {KV_CACHE_DTYPES}{fp8}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", self.quantization, f"must be one of {QUANTIZATIONS} or None")
        if self.quantization is not None and self.dtype in ("float16", "bfloat16"):
            raise bad("dtype", self.dtype,
                      f"quantization={self.quantization!r} computes in float32 (dtype auto or float32)")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise bad("quantized_activations", self.quantized_activations,
                      f"must be one of {QUANTIZED_ACTIVATIONS}")
        if self.device not in DEVICES:
            raise bad("device", self.device, f"must be one of {DEVICES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", self.attention_backend, f"must be one of {ATTENTION_BACKENDS}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise bad("structured_outputs_backend", self.structured_outputs_backend,
                      f"must be one of {STRUCTURED_OUTPUTS_BACKENDS}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad("scheduling_policy", self.scheduling_policy,
                      f"must be one of {SCHEDULING_POLICIES}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise bad("block_size", self.block_size, "must be one of 8, 16, 32, 64, 128")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise bad("kv_cache_memory_gb", self.kv_cache_memory_gb, "must be > 0")
        self._check_kv_store(bad)
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise bad("num_gpu_blocks_override", self.num_gpu_blocks_override, "must be >= 1")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", self.max_model_len, "must be >= 1")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise bad(name, v, "must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad("max_cpu_loras", self.max_cpu_loras,
                      f"must be >= max_loras={self.max_loras}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise bad("tensor_parallel_size", self.tensor_parallel_size,
                      "LoRA adapters (enable_lora=True) run on one rank")
        if self.tensor_parallel_size > 1 and self.quantization in ("gguf", "gptq", "awq"):
            raise bad("tensor_parallel_size", self.tensor_parallel_size,
                      f"quantization={self.quantization!r} runs on one rank (use a float "
                      "checkpoint, or quantization='int8', for tensor parallel)")

    def _check_kv_store(self, bad: Any) -> None:
        """The KV block store's settings: sizes > 0, a folder and a size together, prefix
        caching on (the store is keyed by its chain keys), one rank."""
        for name in ("kv_host_gb", "kv_store_gb"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise bad(name, v, "must be > 0")
        if self.kv_store_dir is not None and not isinstance(self.kv_store_dir, str):
            raise bad("kv_store_dir", self.kv_store_dir, "must be a folder path")
        if (self.kv_store_dir is None) != (self.kv_store_gb is None):
            given, missing = (("kv_store_dir", "kv_store_gb") if self.kv_store_gb is None
                              else ("kv_store_gb", "kv_store_dir"))  # fmt: skip
            raise bad(given, getattr(self, given), f"needs {missing} too")
        if self.kv_store_dir is None and self.kv_host_gb is None:
            return
        if not self.enable_prefix_caching:
            raise bad("enable_prefix_caching", False, "a KV store (kv_store_dir, kv_host_gb) "
                      "needs prefix caching")
        if self.tensor_parallel_size > 1:
            raise bad("tensor_parallel_size", self.tensor_parallel_size,
                      "a KV store (kv_store_dir, kv_host_gb) runs on one rank")

    @property
    def lora_capacity(self) -> int:
        """Adapters kept loaded (``max_cpu_loras``, default ``max(max_loras, 8)``)."""
        return self.max_cpu_loras or max(self.max_loras, 8)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments; an unknown name is a TypeError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in fields(EngineConfig)]
