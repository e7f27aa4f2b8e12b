"""Fast CPU attention backend built on ``scaled_dot_product_attention``.

The per-step Python work is constant: :meth:`TorchBackend.prepare` builds, once per
step, flat gather indices into the flattened cache, masks and scatter indices for two
groups (the decode requests and the prefill chunks); :meth:`TorchBackend.forward`
then costs, per layer, one ``index_copy_`` per K/V, one gather per K/V and group, and
one SDPA call per group, independent of the number of requests.

GQA never materialises repeated K/V. Decodes fold the ``G = Hq / Hkv`` query heads
sharing a KV head into query rows (``query[:n].view(n, Hkv, G, D)`` is a free view);
prefill chunks use ``enable_gqa=True``, which on CPU measured about 2x faster than
folding (the fold needs two permute copies and a G-times larger mask). Masks are
additive (0 / -inf) in the compute dtype: SDPA converts boolean masks with a
``where`` on every call. See ``kernels/cpu/bench.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels.interface import AttentionMetadata
from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps
from pagedserve.kernels.paged_index import context_slots, padded_rows
from pagedserve.kernels.torch_ref import dequantize_kv_rows, quantize_kv_rows


@dataclass(slots=True)
class _DecodeGroup:
    num_reqs: int
    max_len: int
    slots: torch.Tensor
    """[num_reqs * max_len] flat gather index into the flattened cache."""
    allowed: torch.Tensor
    """[num_reqs, 1, 1, max_len] bool, True = attend."""
    lens: torch.Tensor
    """[num_reqs, 1, 1, 1] int64 context lengths (a window's start is counted from them)."""
    rows: torch.Tensor | None = None
    """The step's decode rows in this group; None = rows ``0..num_reqs-1`` in order."""
    masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
        """Additive key-padding mask in ``dtype`` (the last ``window`` positions only when
        ``window`` > 0), built once per step and window."""
        return _additive(self.masks, self.allowed, dtype, window, lambda: self.allowed & (
            torch.arange(self.max_len, device=self.lens.device) >= self.lens - window))


@dataclass(slots=True)
class _PrefillGroup:
    """Prefill chunks attending through the cache: one padded SDPA call."""

    num_reqs: int
    max_q_len: int
    max_len: int
    slots: torch.Tensor
    """[num_reqs * max_len] flat gather index into the flattened cache."""
    token_index: torch.Tensor
    """[num_reqs * max_q_len] rows of the step's query forming the padded grid."""
    allowed: torch.Tensor
    """[num_reqs, 1, max_q_len, max_len] bool causal mask, True = attend."""
    grid_rows: torch.Tensor
    """Cells of the flattened padded grid that hold real query tokens..."""
    token_rows: torch.Tensor
    """...and the step's token row each of them is."""
    position: torch.Tensor
    """[num_reqs, 1, max_q_len, 1] int64 context position of each grid cell's query."""
    masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
        """Additive causal mask in ``dtype`` (each query's last ``window`` positions
        only when ``window`` > 0), built once per step and window."""
        return _additive(self.masks, self.allowed, dtype, window, lambda: self.allowed & (
            torch.arange(self.max_len, device=self.position.device) > self.position - window))


def _additive(
    cache: dict[tuple[torch.dtype, int], torch.Tensor], allowed: torch.Tensor,
    dtype: torch.dtype, window: int = 0, windowed=None,
) -> torch.Tensor:
    """``allowed`` (``windowed()`` when ``window`` > 0) as a 0 / -inf mask in ``dtype``,
    memoised in ``cache``."""
    mask = cache.get((dtype, window))
    if mask is None:
        keep = windowed() if window > 0 else allowed
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        mask.masked_fill_(~keep, float("-inf"))
        cache[(dtype, window)] = mask
    return mask


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    scale: float, softcap: float = 0.0, causal_window: int | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of ``[..., H, Q, D]`` queries over ``[..., Hkv,
    L, D]`` keys and values (``H`` a multiple of ``Hkv``) with an additive ``mask``, or
    with ``causal_window`` (not None) causally over the query's last ``causal_window``
    positions (0: all of them; queries and keys the same positions). With ``softcap``
    > 0 the scaled scores are capped (``softcap * tanh(s / softcap)``, Gemma 2) before
    the mask: computed here in float32 (SDPA has no such option)."""
    group = q.shape[-3] // k.shape[-3]
    if softcap <= 0 and (causal_window is None or causal_window == 0 or
                         causal_window >= q.shape[-2]):  # fmt: skip
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal_window is not None, scale=scale,
            enable_gqa=group > 1)
    if causal_window is not None:
        n = q.shape[-2]
        pos = torch.arange(n, device=q.device)
        keep = pos[None, :] <= pos[:, None]
        if causal_window > 0:
            keep &= pos[None, :] > pos[:, None] - causal_window
        mask = torch.zeros(keep.shape, dtype=torch.float32, device=q.device)
        mask.masked_fill_(~keep, float("-inf"))
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=group > 1)  # fmt: skip
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


MAX_CAUSAL_CALLS = 32
"""Most whole-context prefill chunks given their own causal SDPA call in one step;
beyond that (many short prompts) one padded call costs less than the calls."""

MIN_BUCKET = 8
"""Fewest decode requests worth their own gather and SDPA call."""
MAX_BUCKETS = 4


def decode_buckets(seq_lens: list[int], shrink: float = 0.7) -> list[list[int]]:
    """Split decode rows into at most ``MAX_BUCKETS`` groups of similar context length.

    Each group is padded to its own longest context, so short contexts no longer pay
    for the longest one in the gather and in SDPA (both memory-bound). A new group
    starts when a context is shorter than ``shrink`` times the group's longest and both
    the group and what is left hold at least ``MIN_BUCKET`` rows. Rows stay in
    ascending order inside a group.
    """
    n = len(seq_lens)
    if n == 0:
        return []
    if n < 2 * MIN_BUCKET:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = [[order[0]]]
    top = seq_lens[order[0]]
    for k, i in enumerate(order[1:], start=1):
        cur = groups[-1]
        if (seq_lens[i] < shrink * top and len(cur) >= MIN_BUCKET
                and n - k >= MIN_BUCKET and len(groups) < MAX_BUCKETS):
            groups.append([i])
            top = seq_lens[i]
        else:
            cur.append(i)
    return [sorted(g) for g in groups]


@dataclass(slots=True)
class TorchStepPlan:
    """Gather indices, masks and scatter indices of one step, made once by
    :meth:`TorchBackend.prepare` and read by every layer."""

    num_tokens: int
    write_slots: torch.Tensor
    write_tokens: torch.Tensor | None
    """Rows of key/value to write (slot != -1), or None when every token is written."""
    decode: list[_DecodeGroup]
    """Decode length buckets from ``_plan_decodes``."""
    prefill: _PrefillGroup | None
    causal: list[tuple[int, int]] = field(default_factory=list)
    """Token ranges of whole-context chunks (a prompt's only chunk, no cached prefix):
    each attends to its own fresh K/V with a causal SDPA call, no gather, no mask."""


def write_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Once per step: the cache slots to write and the token rows they take (None: every
    row, in order); padding tokens (slot -1) are skipped."""
    slot_mapping = meta.slot_mapping.long()
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, None
    write_tokens = keep.nonzero().squeeze(1)
    return slot_mapping.index_select(0, write_tokens), write_tokens


def write_planned_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    write_slots: torch.Tensor, write_tokens: torch.Tensor | None,
) -> None:
    """Write this step's K/V rows into the slots chosen by :func:`write_plan` (quantized
    into an int8 cache)."""
    # Rows of the flattened cache are whole slots: 2-D index ops copy them as one run.
    width = k_cache.shape[2] * k_cache.shape[3]
    if k_cache.dtype == torch.int8:
        key, value = quantize_kv_rows(key), quantize_kv_rows(value)
    k_flat, v_flat = k_cache.view(-1, width), v_cache.view(-1, width)
    key, value = key.reshape(-1, width), value.reshape(-1, width)
    if write_tokens is not None:
        key, value = key.index_select(0, write_tokens), value.index_select(0, write_tokens)
    k_flat.index_copy_(0, write_slots, key.to(k_flat.dtype))
    v_flat.index_copy_(0, write_slots, value.to(v_flat.dtype))


class TorchBackend:
    """Paged attention with torch ops; the CPU path of the engine."""

    name = "torch"

    def __init__(self, ops: LayerOps | None = None) -> None:
        self._workspace: torch.Tensor | None = None
        self.ops: LayerOps = TorchLayerOps() if ops is None else ops

    def _gather_kv(
        self, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
        compute_dtype: torch.dtype, num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather rows ``slots`` of both flat caches into a reused workspace, in
        ``compute_dtype`` (the query's; an int8 cache's rows dequantized, ``[n, Hkv *
        head_dim]``).

        Reusing one buffer across groups, layers and steps avoids allocating (and
        page-faulting) tens of MB per layer; the gathered K/V are consumed by SDPA
        before the next gather.
        """
        n, width = slots.numel(), k_flat.shape[1]
        ws = self._workspace
        if ws is None or ws.numel() < 2 * n * width or ws.dtype != k_flat.dtype \
                or ws.device != k_flat.device:  # fmt: skip
            ws = torch.empty(2 * n * width, dtype=k_flat.dtype, device=k_flat.device)
            self._workspace = ws
        k = torch.index_select(k_flat, 0, slots, out=ws[: n * width].view(n, width))
        v = torch.index_select(v_flat, 0, slots, out=ws[n * width : 2 * n * width].view(n, width))
        if k.dtype == torch.int8:
            k, v = (dequantize_kv_rows(t.view(n, num_kv_heads, -1)).view(n, -1).to(compute_dtype)
                    for t in (k, v))  # fmt: skip
        elif compute_dtype != k.dtype:  # a cache narrower than the model: widen what it holds
            k, v = k.to(compute_dtype), v.to(compute_dtype)
        return k, v

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Build gather indices and masks for this step into ``meta.prepared``."""
        meta.prepared = self.make_plan(meta, block_size)

    def make_plan(self, meta: AttentionMetadata, block_size: int) -> TorchStepPlan:
        """The step's :class:`TorchStepPlan`."""
        qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        seq_lens_cpu = meta.seq_lens_cpu or meta.seq_lens.tolist()
        num_reqs = len(seq_lens_cpu)
        nd = meta.num_decodes
        num_tokens = qsl[-1] if qsl else 0

        write_slots, write_tokens = write_plan(meta)
        decode = self._plan_decodes(meta, seq_lens_cpu[:nd], block_size)

        rows = range(nd, num_reqs)
        fresh = [i for i in rows if qsl[i + 1] - qsl[i] == seq_lens_cpu[i]]
        if len(fresh) > MAX_CAUSAL_CALLS:
            fresh = []
        fresh_set = set(fresh)
        padded = [i for i in rows if i not in fresh_set]
        prefill = self._prefill_group(meta, padded, qsl, seq_lens_cpu, block_size) \
            if padded else None  # fmt: skip
        causal = [(qsl[i], qsl[i + 1]) for i in fresh]
        return TorchStepPlan(num_tokens, write_slots, write_tokens, decode, prefill, causal)

    @staticmethod
    def _prefill_group(
        meta: AttentionMetadata, rows: list[int], qsl: list[int], seq_lens_cpu: list[int],
        block_size: int,
    ) -> _PrefillGroup:
        """One padded group over prefill requests ``rows`` (in any order)."""
        device = meta.block_tables.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        starts = torch.tensor([qsl[i] for i in rows], dtype=torch.long, device=device)
        q_lens_cpu = [qsl[i + 1] - qsl[i] for i in rows]
        q_lens = torch.tensor(q_lens_cpu, dtype=torch.long, device=device)
        seq_lens = meta.seq_lens.index_select(0, index)
        max_q_len = max(q_lens_cpu)
        max_len = max(seq_lens_cpu[i] for i in rows)
        token_index, position, valid = padded_rows(starts, q_lens, seq_lens, max_q_len, qsl[-1])
        slots = context_slots(meta.block_tables.index_select(0, index), seq_lens, max_len,
                              block_size)  # fmt: skip
        pos = torch.arange(max_len, device=device)
        allowed = pos[None, None, :] <= position[:, :, None]
        valid = valid.reshape(-1)
        grid_rows = valid.nonzero().squeeze(1)
        return _PrefillGroup(
            len(rows), max_q_len, max_len, slots.reshape(-1), token_index.reshape(-1),
            allowed[:, None], grid_rows, token_index.reshape(-1).index_select(0, grid_rows),
            position[:, None, :, None],
        )  # fmt: skip

    def _plan_decodes(
        self, meta: AttentionMetadata, seq_lens: list[int], block_size: int
    ) -> list[_DecodeGroup]:
        """Per-step state for the decode rows ``0..len(seq_lens)-1``."""
        return [
            self._decode_group(meta, rows, [seq_lens[i] for i in rows], block_size)
            for rows in decode_buckets(seq_lens)
        ]

    @staticmethod
    def _decode_group(
        meta: AttentionMetadata, rows: list[int], lens: list[int], block_size: int
    ) -> _DecodeGroup:
        device = meta.block_tables.device
        whole = rows == list(range(len(rows)))
        index = None if whole else torch.tensor(rows, dtype=torch.long, device=device)
        seq_lens = meta.seq_lens[: len(rows)] if whole else meta.seq_lens.index_select(0, index)
        tables = meta.block_tables[: len(rows)] if whole else \
            meta.block_tables.index_select(0, index)  # fmt: skip
        max_len = max(lens)
        slots = context_slots(tables, seq_lens, max_len, block_size)
        pos = torch.arange(max_len, device=device)
        mask = pos[None, :] < seq_lens.long()[:, None]
        return _DecodeGroup(len(rows), max_len, slots.reshape(-1), mask[:, None, None, :],
                            seq_lens.long()[:, None, None, None], index)  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend; ``[T, Hq, D]`` -> ``[T, Hq, D]`` (``window``,
        ``softcap``: as :mod:`pagedserve.kernels.torch_ref` defines them)."""
        st = meta.plan(TorchStepPlan)
        total, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        write_planned_kv(key, value, k_cache, v_cache, st.write_slots, st.write_tokens)
        k_flat = k_cache.view(-1, num_kv_heads * k_cache.shape[3])
        v_flat = v_cache.view(-1, num_kv_heads * v_cache.shape[3])

        pre = st.prefill
        if pre is None and not st.causal and total == st.num_tokens and meta.num_decodes:
            # Decode-only step: the decode output is the whole output.
            return self._attend_decodes(query, k_cache, v_cache, meta, scale, None, window,
                                        softcap)  # fmt: skip
        if total > st.num_tokens:
            out = query.new_zeros(total, num_heads, head_dim)
        else:
            out = query.new_empty(total, num_heads, head_dim)
        if meta.num_decodes:
            self._attend_decodes(query, k_cache, v_cache, meta, scale, out[: meta.num_decodes],
                                 window, softcap)  # fmt: skip

        if st.causal and k_cache.dtype == torch.int8:
            # Whole prompts attend to their K/V as the cache holds them, as later steps do.
            key = dequantize_kv_rows(quantize_kv_rows(key)).to(query.dtype)
            value = dequantize_kv_rows(quantize_kv_rows(value)).to(query.dtype)
        elif st.causal and k_cache.dtype != query.dtype:
            key = key.to(k_cache.dtype).to(query.dtype)
            value = value.to(v_cache.dtype).to(query.dtype)
        for a, b in st.causal:
            # 4-D [1, H, L, D] views: SDPA's CPU flash kernel (3-D inputs take the math path).
            o = attention(
                query[None, a:b].transpose(1, 2),
                key[None, a:b].view(1, b - a, num_kv_heads, head_dim).transpose(1, 2),
                value[None, a:b].view(1, b - a, num_kv_heads, head_dim).transpose(1, 2),
                None, scale, softcap, causal_window=window,
            )  # fmt: skip
            out[a:b] = o[0].transpose(0, 1)
        if pre is not None:
            p, ql, length = pre.num_reqs, pre.max_q_len, pre.max_len
            k, v = self._gather_kv(k_flat, v_flat, pre.slots, query.dtype, num_kv_heads)
            k = k.view(p, length, num_kv_heads, head_dim)
            v = v.view(p, length, num_kv_heads, head_dim)
            q = query.index_select(0, pre.token_index).view(p, ql, num_heads, head_dim)
            o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          pre.mask(query.dtype, window), scale, softcap)
            o = o.transpose(1, 2).reshape(p * ql, num_heads, head_dim)
            out.index_copy_(0, pre.token_rows, o.index_select(0, pre.grid_rows))
        return out

    def _attend_decodes(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of the decode rows ``query[:num_decodes]``, into ``out`` if given.

        Each length bucket gathers its K/V through the block tables and runs one SDPA
        call, the ``G`` query heads of a KV head folded into query rows.
        """
        nd = meta.num_decodes
        _, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        k_flat = k_cache.view(-1, num_kv_heads * k_cache.shape[3])
        v_flat = v_cache.view(-1, num_kv_heads * v_cache.shape[3])
        groups = meta.plan(TorchStepPlan).decode
        for g in groups:
            n, length = g.num_reqs, g.max_len
            k, v = self._gather_kv(k_flat, v_flat, g.slots, query.dtype, num_kv_heads)
            k = k.view(n, length, num_kv_heads, head_dim)
            v = v.view(n, length, num_kv_heads, head_dim)
            q = query[:n] if g.rows is None else query.index_select(0, g.rows)
            o = attention(q.view(n, num_kv_heads, group, head_dim), k.transpose(1, 2),
                          v.transpose(1, 2), g.mask(query.dtype, window), scale,
                          softcap).reshape(n, num_heads, head_dim)  # fmt: skip
            if out is None:
                if len(groups) == 1 and g.rows is None:
                    return o
                out = query.new_empty(nd, num_heads, head_dim)
            if g.rows is None:
                out[:n] = o
            else:
                out.index_copy_(0, g.rows, o)
        assert out is not None
        return out
