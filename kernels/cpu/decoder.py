"""Every decoder layer of a step in one native call: :class:`FusedLayers`.

On a decode step of a small model the per-layer loop makes ~10 calls into the native
library a layer, and the Python around them (argument checks, views, output tensors,
ctypes marshalling) costs as much as the arithmetic. ``csrc/decoder_cpu.c`` runs the
same kernels in the same order, with the same arguments and thread count, from two
tables of addresses built once per model and KV cache: the result is bit-identical to
the loop, which stays the path for everything the tables cannot describe.

A step is fused when its activations are float32, every linear of the model runs in the
native library at the step's row count (float32 weights through the native linear, where
this build has one; weight-only quantized ones in registers, up to
:meth:`~pagedserve.kernels.cpu.layer_ops.NativeLayerOps.quant_rows`; never more than
:data:`~pagedserve.kernels.cpu.layer_ops.FUSED_MAX_ROWS` rows, since the call's scratch grows
with its rows), and the caches are the contiguous CPU tensors the attention kernel takes. Weights must not change once a fused step has
run (the tables hold their addresses; a rebuilt :class:`~pagedserve.kernels.interface.DecoderStack`
gets new tables).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import abi
from pagedserve.kernels.cpu.layer_ops import FUSED_MAX_ROWS, NativeLayerOps
from pagedserve.kernels.cpu.native import DTYPE_CODES, kv_layout
from pagedserve.kernels.interface import (
    DecoderStack,
    ExpertWeights,
    LayerWeights,
    Weight,
    kv_row_width,
)
from pagedserve.kernels.quant import QuantizedWeight, StackedWeight

C = abi.CONSTANTS


@dataclass(slots=True)
class _Tables:
    """One model's tables for one set of KV caches, and what keeps their addresses live."""

    stack: DecoderStack
    kv_caches: list
    model: torch.Tensor
    layers: torch.Tensor
    max_rows: int
    groups: int
    """The KV groups the layers read (one more than the highest ``kv_group``)."""
    keep: list


class FusedLayers:
    """Runs a :class:`~pagedserve.kernels.interface.DecoderStack` through ``decoder_layers``."""

    def __init__(self, lib: ctypes.CDLL, ops: NativeLayerOps) -> None:
        self._lib = lib
        self._ops = ops
        self._tables: _Tables | None = None
        self._unfit: tuple[DecoderStack, list] | None = None
        """The last stack and caches found not to fit (checked once, not every step)."""
        self._scratch = torch.empty(0, dtype=torch.float32)

    def run(self, stack: DecoderStack, hidden: torch.Tensor, positions: torch.Tensor,
            kv_caches: list, plans: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(last MLP output, residual)`` for the step, or None when it is not fused.
        ``hidden`` (the embeddings, float32 ``[T, hidden]``) becomes the residual, updated
        in place as the loop updates it; ``plans`` are the step's
        :class:`~pagedserve.kernels.cpu.backend.CpuStepPlan`, one a KV group."""
        rows = hidden.shape[0]
        if not (0 < rows == plans[0].num_tokens and hidden.dtype == torch.float32
                and hidden.is_cpu and hidden.is_contiguous() and positions.is_cpu):  # fmt: skip
            return None
        tables = self._tables_for(stack, kv_caches)
        if tables is None or rows > tables.max_rows or tables.groups > len(plans):
            return None
        steps = self._steps(plans)
        if steps is None:
            return None
        need = self._lib.decoder_scratch_size(tables.model.data_ptr(), rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        pos = positions.to(torch.int64).contiguous()
        out = torch.empty_like(hidden)
        status = self._lib.decoder_layers(
            tables.model.data_ptr(), tables.layers.data_ptr(), steps.data_ptr(),
            hidden.data_ptr(), out.data_ptr(), stack.eps, stack.scale, stack.softcap,
            pos.data_ptr(), rows, plans[0].seq_lens.shape[0], self._scratch.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"decoder_layers: {abi.DECODER_ERRORS.get(status, status)}")
        return out, hidden

    @staticmethod
    def _steps(plans: list) -> torch.Tensor | None:
        """The DS_* table of the step's KV groups, or None when they do not describe the
        same requests and rows."""
        first = plans[0]
        table = [0] * (C["DS_SIZE"] * len(plans))
        for i, plan in enumerate(plans):
            if i and not (plan.num_tokens == first.num_tokens
                          and plan.seq_lens.shape == first.seq_lens.shape
                          and (plan.query_start_loc is None) == (first.query_start_loc is None)):
                return None  # fmt: skip
            at = i * C["DS_SIZE"]
            qsl = plan.query_start_loc
            for name, value in (("DS_BLOCK_TABLES", plan.block_tables.data_ptr()),
                                ("DS_SEQ_LENS", plan.seq_lens.data_ptr()),
                                ("DS_QUERY_START_LOC", 0 if qsl is None else qsl.data_ptr()),
                                ("DS_SLOTS", plan.slot_mapping.data_ptr()),
                                ("DS_MAX_BLOCKS", plan.block_tables.shape[1]),
                                ("DS_MAX_SEQ_LEN", plan.max_seq_len)):  # fmt: skip
                table[at + C[name]] = value
        return torch.tensor(table, dtype=torch.int64)

    def _tables_for(self, stack: DecoderStack, kv_caches: list) -> _Tables | None:
        t = self._tables
        if t is not None and t.stack is stack and t.kv_caches is kv_caches:
            return t
        if self._unfit is not None and self._unfit[0] is stack and self._unfit[1] is kv_caches:
            return None
        self._tables = self._build(stack, kv_caches)
        self._unfit = None if self._tables is not None else (stack, kv_caches)
        return self._tables

    def _build(self, stack: DecoderStack, kv_caches: list) -> _Tables | None:
        """The tables, or None when some part of the model is not one the call takes."""
        if len(kv_caches) != len(stack.layers) or not stack.layers:
            return None
        k0 = kv_caches[0][0]
        layout = kv_layout(k0)
        width = (stack.num_kv_heads, kv_row_width(stack.head_dim, k0.dtype))
        if layout is None or k0.dtype not in DTYPE_CODES or tuple(k0.shape[2:]) != width or (
                stack.head_dim > abi.MAX_HEAD_DIM):
            return None
        if stack.activation not in ACTIVATIONS:  # the RoPE tables: each layer's checked
            return None
        model = torch.tensor([0] * C["DM_SIZE"], dtype=torch.int64)
        for name, value in (("DM_NUM_LAYERS", len(stack.layers)), ("DM_HIDDEN", stack.hidden_size),
                            ("DM_HEADS", stack.num_heads), ("DM_KV_HEADS", stack.num_kv_heads),
                            ("DM_HEAD_DIM", stack.head_dim),
                            ("DM_INTER", stack.intermediate_size),
                            ("DM_KV_DTYPE", DTYPE_CODES[k0.dtype]),
                            ("DM_BLOCK_SIZE", k0.shape[1]), ("DM_NUM_BLOCKS", k0.shape[0]),
                            ("DM_KV_LAYOUT", layout),
                            ("DM_ACTIVATION", ACTIVATIONS[stack.activation])):
            model[C[name]] = value
        keep: list = [stack.rope_cos, stack.rope_sin]
        entries: list[int] = []
        max_rows = FUSED_MAX_ROWS
        for layer, (k_cache, v_cache) in zip(stack.layers, kv_caches, strict=True):
            row = self._layer_row(stack, layer, k_cache, v_cache, k0, keep)
            if row is None:
                return None
            entries += row[0]
            max_rows = min(max_rows, row[1])
            model[C["DM_MOE_ROW"]] = max(int(model[C["DM_MOE_ROW"]]), row[2])
        groups = 1 + max(layer.kv_group for layer in stack.layers)
        return _Tables(stack, kv_caches, model, torch.tensor(entries, dtype=torch.int64),
                       max_rows, groups, keep)  # fmt: skip

    def _layer_row(self, stack, layer: LayerWeights, k_cache, v_cache, k0, keep):
        """A layer's DL_SIZE entries, the most rows its linears take and the scratch floats
        a row its experts need, or None."""
        for cache in (k_cache, v_cache):
            if not (cache.shape == k0.shape and cache.dtype == k0.dtype and cache.is_cpu
                    and kv_layout(cache) == kv_layout(k0)):  # fmt: skip
                return None
        if (layer.q_norm is None) != (layer.k_norm is None) or layer.kv_group < 0 or \
                (layer.rope_cos is None) != (layer.rope_sin is None):  # fmt: skip
            return None
        vectors = [v for v in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                               layer.attn_out_norm, layer.mlp_out_norm) if v is not None]
        if not all(_f32_vector(v) for v in vectors):
            return None
        cos = stack.rope_cos if layer.rope_cos is None else layer.rope_cos
        sin = stack.rope_sin if layer.rope_sin is None else layer.rope_sin
        if not (_rope_table(cos, stack) and _rope_table(sin, stack)):
            return None
        row = [0] * C["DL_SIZE"]
        row[C["DL_WINDOW"]], row[C["DL_GROUP"]] = layer.window, layer.kv_group
        for name, v in (("DL_INPUT_NORM", layer.input_norm), ("DL_POST_NORM", layer.post_norm),
                        ("DL_Q_NORM", layer.q_norm), ("DL_K_NORM", layer.k_norm),
                        ("DL_K_CACHE", k_cache), ("DL_V_CACHE", v_cache),
                        ("DL_ATTN_OUT_NORM", layer.attn_out_norm),
                        ("DL_MLP_OUT_NORM", layer.mlp_out_norm), ("DL_COS", cos),
                        ("DL_SIN", sin)):  # fmt: skip
            row[C[name]] = 0 if v is None else v.data_ptr()
        keep.extend(vectors + [cos, sin])
        q, kv = stack.num_heads * stack.head_dim, stack.num_kv_heads * stack.head_dim
        shapes = {"DL_QKV": (layer.qkv, layer.qkv_bias, q + 2 * kv, stack.hidden_size),
                  "DL_O": (layer.o, layer.o_bias, stack.hidden_size, q),
                  "DL_GATE_UP": (layer.gate_up, layer.gate_up_bias, 2 * stack.intermediate_size,
                                 stack.hidden_size),
                  "DL_DOWN": (layer.down, layer.down_bias, stack.hidden_size,
                              stack.intermediate_size)}  # fmt: skip
        max_rows, moe_row = FUSED_MAX_ROWS, 0
        if layer.experts is not None:
            shapes.pop("DL_GATE_UP"), shapes.pop("DL_DOWN")
            table = self._expert_table(stack.hidden_size, layer.experts, keep)
            if table is None:
                return None
            row[C["DL_MOE"]], max_rows = table[0].data_ptr(), table[1]
            moe_row = self._lib.moe_scratch_per_row(table[0].data_ptr(), stack.hidden_size)
        linears = [(C[name], weight, bias, n, k, order) for (name, (weight, bias, n, k)), order
                   in zip(shapes.items(), layer.orders[:len(shapes)], strict=True)]  # fmt: skip
        filled = self._fill(row, linears, keep)
        if filled is None:
            return None
        return row, min(max_rows, filled), moe_row

    def _expert_table(self, hidden: int, ex: ExpertWeights, keep):
        """A layer's MOE_* table (kept alive in ``keep``) and the most rows its linears
        take, or None."""
        num, size = len(ex.gate_up), C["LIN_SIZE"]
        inter = ex.down[0].shape[1]
        shared = 0 if ex.shared_down is None else ex.shared_down.shape[1]
        table = [0] * (C["MOE_FIRST_EXPERT"] + 2 * num * size)
        for name, value in (("MOE_EXPERTS", num), ("MOE_TOP_K", ex.top_k), ("MOE_INTER", inter),
                            ("MOE_SHARED_INTER", shared),
                            ("MOE_NORM_TOPK", int(ex.norm_topk_prob))):  # fmt: skip
            table[C[name]] = value
        linears = [(C["MOE_ROUTER"], ex.router, None, num, hidden, None)]
        if shared:
            linears += [(C["MOE_SHARED_GATE"], ex.shared_gate, None, 1, hidden, None),
                        (C["MOE_SHARED_GATE_UP"], ex.shared_gate_up, None, 2 * shared, hidden,
                         ex.shared_orders[0]),
                        (C["MOE_SHARED_DOWN"], ex.shared_down, None, hidden, shared,
                         ex.shared_orders[1])]  # fmt: skip
        for e, (gate_up, down, (up_order, down_order)) in enumerate(
                zip(ex.gate_up, ex.down, ex.orders, strict=True)):  # fmt: skip
            at = C["MOE_FIRST_EXPERT"] + 2 * e * size
            linears += [(at, gate_up, None, 2 * inter, hidden, up_order),
                        (at + size, down, None, hidden, inter, down_order)]
        max_rows = self._fill(table, linears, keep)
        if max_rows is None:
            return None
        tensor = torch.tensor(table, dtype=torch.int64)
        keep.append(tensor)
        return tensor, max_rows

    def _fill(self, table: list, linears: list, keep) -> int | None:
        """Writes each ``(at, weight, bias, n, k, order)``'s LIN_SIZE entries into ``table``
        at ``at``; returns the most rows all of them take natively, or None."""
        max_rows = FUSED_MAX_ROWS
        for at, weight, bias, n, k, order in linears:
            lin = self._linear_entries(weight, bias, n, k, keep, order)
            if lin is None:
                return None
            table[at: at + C["LIN_SIZE"]] = lin[0]
            max_rows = min(max_rows, lin[1])
        return max_rows

    def _linear_entries(self, weight: Weight, bias, n: int, k: int, keep, order=None):
        """A linear's LIN_SIZE entries and the most rows it takes natively, or None."""
        if bias is not None and not (_f32_vector(bias) and bias.numel() == n):
            return None
        if order is not None and not (order.dtype == torch.int64 and order.is_cpu
                                      and order.shape == (k,) and order.is_contiguous()
                                      and 0 <= int(order.min()) <= int(order.max()) < k):
            return None  # the native gather reads x[order[j]] unchecked
        lin = [0] * C["LIN_SIZE"]
        lin[C["LIN_BIAS"]], lin[C["LIN_N"]], lin[C["LIN_K"]] = (
            0 if bias is None else bias.data_ptr(), n, k)
        if bias is not None:
            keep.append(bias)
        if order is not None:
            lin[C["LIN_ORDER"]] = order.data_ptr()
            keep.append(order)
        if isinstance(weight, QuantizedWeight):
            if weight.shape != (n, k) or weight.device.type != "cpu":
                return None
            if not all(p.is_contiguous() for p in weight.planes):
                return None
            packed = self._ops.quant_packed(weight)
            keep.append(packed)
            lin[C["LIN_FMT"]], lin[C["LIN_W"]] = self._ops.quant_code(weight), packed.data_ptr()
            return lin, self._ops.quant_rows(weight)
        if isinstance(weight, StackedWeight):
            parts = self._stacked_parts(weight, bias, n, k, keep)
            if parts is None:
                return None
            lin[C["LIN_FMT"]], lin[C["LIN_W"]] = C["LIN_STACK"], parts.data_ptr()
            return lin, self._ops.quant_rows(weight)
        packed = self._ops.native_packed(weight)
        if packed is None or tuple(weight.shape) != (n, k):
            return None
        keep.append(packed)
        pair = self._ops.native_pair(weight)  # a gate/up weight in pairs (gemm_f32_pair)
        lin[C["LIN_FMT"]] = C["LIN_F32_PAIR"] if pair else C["LIN_F32"]
        lin[C["LIN_W"]] = packed.data_ptr()
        return lin, FUSED_MAX_ROWS

    def _stacked_parts(self, weight: StackedWeight, bias, n: int, k: int, keep):
        """A stacked linear's LIN_STACK table (kept alive in ``keep``), or None."""
        if weight.shape != (n, k) or weight.device.type != "cpu":
            return None
        size = C["LIN_SIZE"]
        table, row = [len(weight.parts)] + [0] * (size * len(weight.parts)), 0
        for i, part in enumerate(weight.parts):
            if not all(p.is_contiguous() for p in part.planes):
                return None
            packed = self._ops.quant_packed(part)
            keep.append(packed)
            at = 1 + i * size
            table[at + C["LIN_FMT"]], table[at + C["LIN_W"]] = self._ops.quant_code(part), packed.data_ptr()
            table[at + C["LIN_N"]], table[at + C["LIN_K"]] = part.n, k
            if bias is not None:  # float32: 4 bytes a row
                table[at + C["LIN_BIAS"]] = bias.data_ptr() + 4 * row
            row += part.n
        tensor = torch.tensor(table, dtype=torch.int64)
        keep.append(tensor)
        return tensor


ACTIVATIONS = {"silu": C["ACT_SILU"], "gelu_tanh": C["ACT_GELU_TANH"]}
"""The MLP activations the call computes -> their DM_ACTIVATION codes."""


def _rope_table(t: torch.Tensor, stack: DecoderStack) -> bool:
    return (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and t.dim() == 2
            and t.shape[1] == stack.head_dim)  # fmt: skip


def _f32_vector(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.dim() == 1 and t.is_contiguous()
