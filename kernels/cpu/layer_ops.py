"""The layer ops in the native CPU library: :class:`NativeLayerOps`.

:class:`NativeLayerOps` implements :class:`pagedserve.kernels.layer_ops.LayerOps` with one call
into the native library per op for float32 and bfloat16 CPU tensors (bfloat16 rounded
where the torch expression rounds: fused RMSNorm with the residual add, RoPE,
SiLU-and-multiply, greedy sampling's argmax over float32 logits), and falls back to
:class:`~pagedserve.kernels.layer_ops.TorchLayerOps` for anything else. On a decode step of a
small model the torch versions cost more in dispatch and thread wake-ups than in
arithmetic: RMSNorm alone is six ops. The native version of ``add_rms_norm`` updates
``residual`` in place.

Linear layers go through ``ops.linear`` too, with weights packed once at load. In
float32 the native library's own linear (``csrc/gemm_cpu.c``) runs at every row count
on AVX-512 builds and up to 256 rows (decode steps) on AVX2 builds
(:data:`NATIVE_LINEAR_ROWS`): in a decode forward of the default model its linears take
10-35% less time than oneDNN's packed linear or ``F.linear`` (oneDNN ran three of the
four layer shapes at one core's speed on two cores), and at prefill sizes on a Zen 5 it
ran at 0.87-0.98 of the FMA peak where ``F.linear`` ran at 0.4; each output is one
multiply-add chain in k order, so a row's result does not depend on the other rows in
the batch. Larger float32 batches on AVX2 builds use oneDNN's packed weights
(0.78-0.91x ``F.linear``'s time at 300-2048 rows on an AMD EPYC). bfloat16 uses weights pre-packed
for oneDNN at every size (15-50% faster than ``F.linear``) where oneDNN has a bfloat16
path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere ``F.linear``), as does float32 on
builds without a vector path (2 to 1024 rows). The packed copy lives beside the weight
(the linear weights' memory twice); ``pack_weights=False`` (the engine's
``PAGEDSERVE_PACK_WEIGHTS=0``) turns packing off.
:meth:`NativeLayerOps.paths` says which linear each dtype takes. Weight-only quantized
weights are multiplied by ``csrc/qgemm_cpu.c`` (:mod:`pagedserve.kernels.cpu.quant`) from a copy
packed at load in groups of output columns, which then replaces the planes: prefill-sized
products and embedding lookups dequantize the packed copy (the same bits), and the planes'
memory is freed, so a quantized model is held once. With 8-bit activations
(``quantized_activations``: ``"int8"``, or ``"auto"`` on the AVX2 and AVX-512 builds),
the GGUF formats' weights are packed for the integer-dot product instead
(``csrc/qgemm_i8.h``: 2.2-2.8x faster than float activations at 1-32 rows on an AVX2 Zen 3,
0.1-0.3% relative error against the float product), with VNNI's integer dots where the CPU
has them (:func:`~pagedserve.kernels.cpu.native.use_int8_dots`; the same sums as AVX2's
maddubs); per-row int8 weights keep float activations.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.abi import MAX_HEAD_DIM, PAIR_GELU_TANH, PAIR_SILU, PAIR_SPLIT
from pagedserve.kernels.cpu.native import isa as build_isa
from pagedserve.kernels.cpu.native import use_int8_dots
from pagedserve.kernels.cpu.quant import (
    INT8_ACTIVATION_FORMATS,
    cached_pack,
    format_code,
    native_dequantize,
    native_linear,
    packed_size,
)
from pagedserve.kernels.layer_ops import TorchLayerOps, rms_norm
from pagedserve.kernels.quant import QuantizedWeight, StackedWeight

log = logging.getLogger("pagedserve.kernels.cpu.layer_ops")

NATIVE_LINEAR_ROWS = {"avx512": None, "avx2": 256}
"""Float32 row counts up to which the native linear runs, by build level (None: every
count). Past 256 rows AVX2 builds take oneDNN's packed weights: the native linear took
0.93-1.11x their time at 256-2,048 rows (oneDNN and MKL held to AVX2 on a Zen 5). On
AVX-512 builds the native linear took 0.85-1.09x the time of oneDNN's packed weights and
0.38-0.48x ``F.linear``'s at 64-2,048 rows (torch's MKL ran at about 0.4 of the FMA peak
on that AMD CPU; BENCHMARKS.md A6), and needs no second copy of the weights."""
FUSED_MAX_ROWS = 256
"""The most rows a step fuses its decoder layers for (the fused call's scratch grows with
its rows): float32 weights' limit there (quantized weights: the least of this and
:meth:`NativeLayerOps.quant_rows`)."""
PACKED_F32_ROWS = (2, 1024)
"""Without the native linear: row counts for which float32 uses oneDNN's packed weights
(bfloat16: every count)."""
QUANT_DIRECT_ROWS = {"avx512": 1024, "avx2": 64, "portable": 32}
"""Quantized weights: row counts up to which the native kernel multiplies in registers, by
build level; larger batches dequantize the weight once and take a float product (where
that measured faster: BENCHMARKS.md)."""
QUANT_DIRECT_ROWS_INT8 = {"avx512": 8192, "avx2": 512, "portable": 32}
"""The same with 8-bit activations (the formats of ``INT8_ACTIVATION_FORMATS``; the
per-row int8 format keeps float activations and :data:`QUANT_DIRECT_ROWS`), but for
:data:`QUANT_DIRECT_ROWS_INT8_BY_FORMAT`. On an AVX2 Zen 3 the integer-dot product took
0.44-0.99x the time of the dequantized weight's float product at 128-512 rows for the
32-weight formats and Q4_K (``python -m pagedserve.loadtest.qgemm_bench
--vs-dequantized``, the default model's three shapes of linear; 0.71-1.19x at 1,024:
BENCHMARKS.md B22). On AVX-512 builds (a Zen 5) the integer product took 0.40-0.62x the
dequantized product's time at 1,024-4,096 rows with 256-bit VNNI dots (Q6_K 0.90-0.94x)
and 0.48-0.87x with maddubs', flat in the rows (A14; 512-bit VNNI is faster still): every
prefill chunk of the default budgets stays in registers."""
QUANT_DIRECT_ROWS_INT8_BY_FORMAT = {"avx2": {"q5_k": 128, "q6_k": 128}}
"""Formats whose integer product falls behind sooner, by build level: on the same Zen 3,
Q5_K and Q6_K took 0.95-1.03x the dequantized product's time at 128 rows, 0.96-1.13x
at 256 and 1.4-1.8x at 512."""
QUANTIZED_ACTIVATIONS = ("auto", "int8", "float")
"""How quantized linears take their activations (:class:`NativeLayerOps`)."""


_NATIVE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
"""Dtypes with native element-wise ops, and the suffix of their C functions."""


def _native_dtype(*tensors: torch.Tensor) -> str | None:
    """The C suffix when every tensor is on the CPU in one dtype that has native ops."""
    dtype = tensors[0].dtype
    suffix = _NATIVE_DTYPES.get(dtype)
    if suffix is None:
        return None
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return None
    return suffix


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class NativeLayerOps(TorchLayerOps):
    """:class:`~pagedserve.kernels.layer_ops.LayerOps` in one native call each (float32 and bfloat16
    on the CPU), torch for the rest."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, pack_weights: bool = True,
                 quantized_activations: str = "auto", int8_dots: str = "auto",
                 quant_max_rows: int | None = None) -> None:
        self._lib = lib
        self.isa = build_isa(lib)
        if quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"quantized_activations={quantized_activations!r}: expected one "
                             f"of {QUANTIZED_ACTIVATIONS}")  # fmt: skip
        self.int8_activations = quantized_activations == "int8" or (
            quantized_activations == "auto" and self.isa != "portable")
        """Whether quantized weights (but the per-row int8 format) take 8-bit activations
        (``auto``: on the vector builds, where the integer dot products measured faster;
        the portable build's are scalar loops)."""
        self.int8_dots = use_int8_dots(lib, int8_dots)
        """The integer dots of the 8-bit products (``vnni512``, ``vnni``, ``maddubs``; None
        on the portable build): ``auto`` takes the widest VNNI the build and CPU have. The
        choice is the library's, for every caller in the process; every kind gives the
        same sums."""
        self._float_rows = QUANT_DIRECT_ROWS.get(self.isa, QUANT_DIRECT_ROWS["portable"])
        rows = QUANT_DIRECT_ROWS_INT8 if self.int8_activations else QUANT_DIRECT_ROWS
        self.quant_max_rows = rows.get(self.isa, rows["portable"])
        """Row counts up to which quantized weights take the native kernel (the most of
        any format: :meth:`quant_rows` says a weight's)."""
        self._rows_by_format = (QUANT_DIRECT_ROWS_INT8_BY_FORMAT.get(self.isa, {})
                                if self.int8_activations else {})  # fmt: skip
        if quant_max_rows is not None:  # one limit for every format (benchmarks)
            self.quant_max_rows, self._rows_by_format = quant_max_rows, {}
        # Reused float32 copy of a quantized weight for prefill-sized products.
        self._dequant_scratch = torch.empty(0, dtype=torch.float32)
        packing = pack_weights
        self._gemm = packing and bool(lib.gemm_f32_available())
        self._packing = packing and torch.backends.mkldnn.is_available()
        # oneDNN refuses bfloat16 weights on CPUs without AVX-512 BW/VL/DQ or
        # AVX-NE-CONVERT ("bf16 path needs the cpu support ...").
        self._packing_bf16 = self._packing and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        # Float32 batches past the native linear's rows: oneDNN's packed weights where
        # they beat F.linear (AVX2 builds; see the module docstring).
        self.native_max_rows = NATIVE_LINEAR_ROWS.get(self.isa, FUSED_MAX_ROWS)
        """Float32 row counts up to which the native linear runs (None: every count)."""
        self._packed_above_native = (self._gemm and self._packing
                                     and self.native_max_rows is not None)  # fmt: skip

    def paths(self) -> dict[str, str]:
        """What each op runs here: ``layer_ops`` (the library's vector level),
        ``linear_f32``, ``linear_bf16`` and ``linear_quant`` (weight-only quantized)."""
        if self._gemm:
            if self.native_max_rows is None:
                f32 = f"native-{self.isa} (every row count)"
            else:
                above = "onednn-packed" if self._packed_above_native else "torch"
                f32 = f"native-{self.isa} (1-{self.native_max_rows} rows), {above} above"
        elif self._packing:
            f32 = f"onednn-packed ({PACKED_F32_ROWS[0]}-{PACKED_F32_ROWS[1]} rows), torch else"
        else:
            f32 = "torch"
        dots = f", {self.int8_dots} dots" if self.int8_dots else ""
        acts = (f"int8 activations{dots} (float for int8-format weights)"
                if self.int8_activations else "float activations")
        return {"layer_ops": self.isa, "linear_f32": f32,
                "linear_bf16": "onednn-packed" if self._packing_bf16 else "torch",
                "linear_quant": f"native-{self.isa} ({acts}; 1-{self.quant_max_rows} rows"
                                f"{self._rows_note()}), dequantize + torch above",
                "quant_activations": "int8" if self.int8_activations else "float",
                "int8_dots": self.int8_dots or "none"}

    def _rows_note(self) -> str:
        """The formats whose row limit is lower than :attr:`quant_max_rows`, for paths()."""
        lower = dict(self._rows_by_format)
        if self.int8_activations and self._float_rows < self.quant_max_rows:
            lower["int8"] = self._float_rows
        return "".join(f", {fmt} 1-{rows}" for fmt, rows in sorted(lower.items()))

    def fma_peak_gflops(self, num_threads: int | None = None) -> float | None:
        """This CPU's float32 multiply-add peak at the library's vector width, GFLOP/s
        (an OpenMP team of ``num_threads`` threads, default torch's count): register-only
        chains, no memory traffic. ``None`` for the portable build, whose loops have no
        such ceiling of their own, or when OpenMP gives fewer threads than asked."""
        g = self._lib.fma_peak_gflops(num_threads or torch.get_num_threads())
        return g if g > 0 else None

    def prepare_weights(
        self, weights: Iterable[torch.Tensor | QuantizedWeight],
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        gated: Iterable[torch.Tensor | QuantizedWeight] = (),
    ) -> None:
        """Pack every CPU float32/bfloat16 and quantized weight now rather than on the
        first step. The native linear's panels of all the float32 weights share one
        tensor from ``allocate`` (the engine's: on huge pages, where the hardware
        prefetchers stream a panel without stopping at every 4 KiB page), as do the
        quantized weights' packed copies. The ``gated`` float32 weights are packed in
        gate/up pairs (:meth:`gated_linear`)."""
        for w in gated:
            self._mark_pair(w)
        weights = [w for w in dict.fromkeys(weights) if w.device.type == "cpu"]  # tied: once
        weights = [p for w in weights for p in (w.parts if isinstance(w, StackedWeight) else (w,))]
        quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
        weights = [w for w in weights if not isinstance(w, QuantizedWeight)]
        self._pack_quantized(quantized, allocate or _torch_empty)
        if self._gemm:
            self._pack_native([w for w in weights if w.dtype == torch.float32 and w.dim() == 2],
                              allocate or _torch_empty)
        for w in weights:
            f32_packed = not self._gemm or self._packed_above_native
            if (w.dtype == torch.float32 and self._packing and f32_packed
                    or w.dtype == torch.bfloat16 and self._packing_bf16):  # fmt: skip
                try:
                    self._packed(w)
                except (RuntimeError, AttributeError) as exc:
                    self._packing = False
                    log.warning("oneDNN weight packing unavailable, using F.linear: %s", exc)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return self._quant_linear(x, weight, bias)
        if isinstance(weight, StackedWeight):
            return weight.linear(self.linear, x, bias)
        if self._use_native(x, weight, bias):
            return self._gemm_linear(x, weight, bias)
        if not self._use_packed(x, weight):
            return F.linear(x, weight, bias)
        try:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed(weight), bias, "none",
                                                      [], "")  # fmt: skip
        except (RuntimeError, AttributeError) as exc:
            self._packing = False
            log.warning("oneDNN packed linear unavailable, using F.linear: %s", exc)
            return F.linear(x, weight, bias)

    def _quant_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not (x.dim() == 2 and x.shape[1] == weight.k and x.stride(1) == 1
                and weight.device.type == "cpu" and _native_dtype(x) == "f32"
                and (bias is None or _native_dtype(bias) == "f32" and bias.is_contiguous())):  # fmt: skip
            if not weight.released:
                return super().linear(x, weight, bias)
            w = native_dequantize(self._lib, weight, torch.get_num_threads(),
                                  packed=self.quant_packed(weight), code=self.quant_code(weight))
            return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        if x.shape[0] <= self.quant_rows(weight):
            return native_linear(self._lib, x, weight, bias, torch.get_num_threads(),
                                 self.quant_packed(weight), self.quant_code(weight))
        need = weight.n * weight.k
        if self._dequant_scratch.numel() < need:
            self._dequant_scratch = torch.empty(need, dtype=torch.float32)
        w = self._dequant_scratch[:need].view(weight.n, weight.k)
        return F.linear(x, native_dequantize(self._lib, weight, torch.get_num_threads(), out=w,
                                             packed=self.quant_packed(weight),
                                             code=self.quant_code(weight)), bias)  # fmt: skip

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and weight.device.type == "cpu" and ids.is_cpu:
            # A tied embedding is the logits' weight: its planes go once it is packed.
            packed = self.quant_packed(weight) if weight.released else None
            return native_dequantize(self._lib, weight, torch.get_num_threads(), rows=ids,
                                     packed=packed, code=self.quant_code(weight))  # fmt: skip
        return super().embedding(ids, weight)

    def _use_native(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if not (self._gemm and x.dim() == 2 and weight.dim() == 2
                and 1 <= x.shape[0] <= (self.native_max_rows or x.shape[0])
                and x.shape[1] == weight.shape[1]
                and x.stride(1) == 1 and _native_dtype(x, weight) == "f32"):  # fmt: skip
            return False
        return bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()
                                and _native_dtype(bias) == "f32")  # fmt: skip

    def _gemm_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        mode: int = PAIR_SPLIT,
    ) -> torch.Tensor:
        """The native product (of a pair-packed weight: as ``mode`` says, by default the
        plain product)."""
        (rows, k), n = x.shape, weight.shape[0]
        packed = self._native_packed(weight)
        b = None if bias is None else bias.data_ptr()
        if not self.native_pair(weight):
            out = x.new_empty(rows, n)
            self._lib.gemm_f32(x.data_ptr(), x.stride(0), rows, k, packed.data_ptr(), n, b,
                               out.data_ptr(), n, torch.get_num_threads())  # fmt: skip
            return out
        width = n if mode == PAIR_SPLIT else n // 2
        out = x.new_empty(rows, width)
        self._lib.gemm_f32_pair(x.data_ptr(), x.stride(0), rows, k, packed.data_ptr(), n // 2,
                                b, mode, out.data_ptr(), width, torch.get_num_threads())  # fmt: skip
        return out

    def gated_linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None, gelu: bool,
    ) -> torch.Tensor:
        """A float32 gate/up weight in the native linear's pair panels (packed so at
        its first use here, or marked by :meth:`prepare_weights`) gives ``act(gate) *
        up`` from the product's epilogue (``gemm_f32_pair``): the ``[rows, 2 * inter]``
        product is never written (the default model's products with their gates in
        ``bench throughput --op-times``: 0.93-0.96x the time of the product and the gate
        apart in steps with prefill, 0.94x in decode steps, on a Zen 5). The values are
        the same."""
        if isinstance(weight, torch.Tensor) and self._use_native(x, weight, bias):
            self._mark_pair(weight)  # unless its first use packed it plain
            if self.native_pair(weight):
                return self._gemm_linear(x, weight, bias, PAIR_GELU_TANH if gelu else PAIR_SILU)
        return super().gated_linear(x, weight, bias, gelu)

    def _mark_pair(self, weight: torch.Tensor | QuantizedWeight) -> None:
        """Pack ``weight`` (a gate/up weight) in pairs where the native linear takes it,
        unless it is packed already: a weight's panels keep the layout of its first
        packing (the fused call's tables hold their address)."""
        if (self._gemm and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and weight.shape[0] % 2 == 0 and _native_dtype(weight) == "f32"
                and getattr(weight, "_pagedserve_native_packed", None) is None):  # fmt: skip
            weight._pagedserve_gate_up = True

    def native_pair(self, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s native panels are gate/up pairs (``gemm_f32_pair``)."""
        return getattr(weight, "_pagedserve_gate_up", False)

    def native_packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A float32 CPU ``[n, k]`` weight in the native linear's panels (cached on the
        tensor, re-packed if it changes); None where this build has no native linear or
        the weight is not one it takes."""
        if not (self._gemm and isinstance(weight, torch.Tensor) and weight.dim() == 2
                and _native_dtype(weight) == "f32"):  # fmt: skip
            return None
        return self._native_packed(weight)

    def quant_rows(self, weight: QuantizedWeight | StackedWeight) -> int:
        """Row counts up to which ``weight`` takes the native kernel here (a stacked
        weight: its parts' least); more rows dequantize it for a float product."""
        if isinstance(weight, StackedWeight):
            return min(self.quant_rows(p) for p in weight.parts)
        if self.int8_activations and weight.fmt not in INT8_ACTIVATION_FORMATS:
            return self._float_rows  # per-row int8 weights: float activations
        return self._rows_by_format.get(weight.fmt, self.quant_max_rows)

    def quant_code(self, weight: QuantizedWeight) -> int:
        """The native product a CPU quantized weight takes here: its format's code, with
        ``QFLAG_I8A`` where activations go in as 8 bits (:attr:`int8_activations`)."""
        return format_code(weight, self.int8_activations)

    def quant_packed(self, weight: QuantizedWeight) -> torch.Tensor:
        """A CPU quantized weight packed for the native kernel's product
        (:meth:`quant_code`; cached on the weight, packed again if its planes change)."""
        return cached_pack(self._lib, weight, code=self.quant_code(weight))

    def _pack_quantized(self, weights: list[QuantizedWeight],
                        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        """Pack quantized ``weights`` for the native kernel into one tensor from
        ``allocate``, each starting on a cache line, then release their planes: every
        product, dequantization and embedding lookup through these ops reads the packed
        copy, so the weights are held once, not twice."""
        sizes = [-(-packed_size(self._lib, w, self.quant_code(w)) // 64) * 64 for w in weights]
        if not sizes:
            return
        arena = allocate((sum(sizes),), torch.uint8)
        for w, dst in zip(weights, arena.split(sizes), strict=True):
            cached_pack(self._lib, w, dst, self.quant_code(w))
            w.release_planes()

    def _pack_native(self, weights: list[torch.Tensor],
                     allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        """Pack ``weights`` for the native linear into one tensor from ``allocate``, each
        weight's panels starting on a cache line."""
        sizes = [-(-self._packed_size(w) // 16) * 16 for w in weights]
        if not sizes:
            return
        arena = allocate((sum(sizes),), torch.float32)
        for w, dst in zip(weights, arena.split(sizes), strict=True):
            self._native_packed(w, dst)

    def _native_packed(self, weight: torch.Tensor,
                       dst: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` in the native linear's panels (in ``dst`` if given), cached on the
        tensor (re-packed if it changes, or for another build level's panel width)."""
        cached = getattr(weight, "_pagedserve_native_packed", None)
        key = (weight._version, self.isa, self.native_pair(weight))
        if cached is not None and cached[0] == key and dst is None:
            return cached[1]
        w = weight.detach().contiguous()
        n, k = w.shape
        size = self._packed_size(weight)
        packed = torch.empty(size, dtype=torch.float32) if dst is None else dst[:size]
        if self.native_pair(weight):
            self._lib.gemm_f32_pair_pack(w.data_ptr(), n // 2, k, packed.data_ptr())
        else:
            self._lib.gemm_f32_pack(w.data_ptr(), n, k, packed.data_ptr())
        weight._pagedserve_native_packed = (key, packed)
        return packed

    def _packed_size(self, weight: torch.Tensor) -> int:
        n, k = weight.shape
        if self.native_pair(weight):
            return self._lib.gemm_f32_pair_packed_size(n // 2, k)
        return self._lib.gemm_f32_packed_size(n, k)

    def _use_packed(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if not (self._packing and x.dim() == 2 and x.is_cpu and x.dtype == weight.dtype):
            return False
        if x.dtype == torch.bfloat16:
            return self._packing_bf16
        if x.dtype != torch.float32:
            return False
        if self._gemm:
            return self._packed_above_native and x.shape[0] > self.native_max_rows
        return PACKED_F32_ROWS[0] <= x.shape[0] <= PACKED_F32_ROWS[1]

    @staticmethod
    def _packed(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` packed for oneDNN, cached on the tensor (re-packed if it changes)."""
        cached = getattr(weight, "_pagedserve_packed", None)
        if cached is not None and cached[0] == weight._version:
            return cached[1]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        weight._pagedserve_packed = (weight._version, packed)
        return packed

    @staticmethod
    def _rows(*xs: torch.Tensor) -> str | None:
        """The C suffix when every x is a contiguous 2-D CPU tensor of one native dtype."""
        if not all(x.dim() == 2 and x.is_contiguous() for x in xs):
            return None
        return _native_dtype(*xs)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        suffix = self._rows(x)
        if suffix is None or _native_dtype(x, weight) is None:
            return rms_norm(x, weight, eps)
        # Without a delta the kernel only reads ``residual``.
        out = torch.empty_like(x)
        self._add_rms_norm(suffix, x, None, weight, eps, out)
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        suffix = self._rows(residual, delta)
        if suffix is None or delta.shape != residual.shape \
                or _native_dtype(residual, weight) is None:  # fmt: skip
            return super().add_rms_norm(residual, delta, weight, eps)
        out = torch.empty_like(residual)
        self._add_rms_norm(suffix, residual, delta, weight, eps, out)
        return residual, out

    def _add_rms_norm(self, suffix, residual, delta, weight, eps, out) -> None:
        rows, dim = residual.shape
        getattr(self._lib, f"add_rms_norm_{suffix}")(
            residual.data_ptr(), None if delta is None else delta.data_ptr(),
            weight.contiguous().data_ptr(), eps, out.data_ptr(), rows, dim, out.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on q and k (each with unit-stride heads of contiguous head_dim)."""
        t, _, head_dim = q.shape
        cos2, sin2 = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
        suffix = _native_dtype(q, k, cos2, sin2)
        if not (suffix and head_dim <= MAX_HEAD_DIM
                and cos2.is_contiguous() and sin2.is_contiguous()
                and all(x.stride(2) == 1 and x.stride(1) == head_dim for x in (q, k))):  # fmt: skip
            return super().rope(q, k, cos, sin)
        fn, nt = getattr(self._lib, f"rope_{suffix}"), torch.get_num_threads()
        for x in (q, k):
            fn(x.data_ptr(), x.stride(0), t, x.shape[1], head_dim, cos2.data_ptr(),
               sin2.data_ptr(), nt)  # fmt: skip
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        suffix = self._rows(gate_up)
        if suffix is None:
            return super().silu_mul(gate_up)
        return self._gated_mul(f"silu_mul_{suffix}", gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._rows(gate_up) != "f32":  # no bfloat16 kernel: torch's
            return super().gelu_tanh_mul(gate_up)
        return self._gated_mul("gelu_tanh_mul_f32", gate_up)

    def _gated_mul(self, kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
        """The native gate ``kernel`` on ``[rows, 2 inter]`` -> ``[rows, inter]``."""
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        getattr(self._lib, kernel)(gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                                   torch.get_num_threads())  # fmt: skip
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        # Rows may be a column slice of wider logits (vocabulary padding).
        if not (x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0 and x.stride(1) == 1
                and _native_dtype(x) == "f32"):  # fmt: skip
            return super().argmax(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._lib.argmax_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                             out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out
