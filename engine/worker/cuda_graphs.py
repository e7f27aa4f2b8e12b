"""CUDA graphs for decode-only steps.

A decode-only step (every request has exactly one query token) launches the same
kernels every time; at small batch sizes the launches, not the GPU, bound its speed.
:class:`DecodeGraphRunner` captures the model's forward pass once per batch size of a
ladder (:func:`capture_sizes`) over static input buffers (:class:`DecodeBuffers`) and
replays the smallest graph that fits the step, padding the extra rows.

Padding rows have token 0 at position 0, slot ``-1`` (no KV write), context length 1
and block 0 in their block table: they read one cached token and their outputs are
ignored. Block tables are padded to ``ceil(max_model_len / block_size)`` columns.

The attention backend's per-step ``prepare`` runs once, at capture, with every context
at ``max_model_len``: for the Triton backend this fixes the number of split-KV splits of
the decode kernel for the batch size; each request splits its own length in the kernel,
so one graph serves every context length without launching work for the empty tail. Capture needs a backend whose ``forward``
does no host sync and no data-dependent allocation for a decode-only step; the Triton
backend qualifies (:data:`GRAPH_SAFE_BACKENDS`), the torch backend (data-dependent
gather sizes and masks) does not.

Nothing here imports triton or initialises CUDA unless a runner captures graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedserve.blockmgr import cdiv
from pagedserve.engine import envs
from pagedserve.engine.step_buffers import NUMPY_DTYPES, layout
from pagedserve.kernels.interface import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.engine.worker.step_inputs import StepInputs

logger = logging.getLogger("pagedserve.engine.worker.cuda_graphs")

MAX_CAPTURE_SIZE = 256
"""Largest decode batch captured; larger decode batches run eagerly."""
TAIL_BYTES = 1 << 18
"""Room after the graphs' static inputs for the rest of a decode step's staged arrays
(logits rows, block-table rows and changes); a step needing more stages elsewhere and
is copied in."""
_HEAD = ((torch.int64, 0), (torch.int64, 0), (torch.int64, -1), (torch.int32, 1))
"""Dtype and padding value of ``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens``."""
GRAPH_SAFE_BACKENDS = frozenset({"triton"})
"""Attention backends whose decode-only forward can be captured."""


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8 up to 32 and of 16 above,
    up to ``min(max_num_seqs, cap)``, which is always included."""
    if max_num_seqs < 1 or cap < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} and cap={cap} must be >= 1")
    limit = min(max_num_seqs, cap)
    ladder = [1, 2, 4, 8, *range(16, 33, 8), *range(48, cap + 1, 16)]
    sizes = [s for s in ladder if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_batch_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding ``num_reqs`` rows (``sizes`` ascending), or
    None when the batch is empty or larger than every captured size."""
    if num_reqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def max_blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """Block-table columns that cover a context of ``max_model_len`` tokens."""
    return cdiv(max_model_len, block_size)


def graphs_wanted(device: torch.device, enforce_eager: bool, attn: AttentionBackend,
                  model: Any = None) -> bool:
    """Whether decode steps should run as CUDA graphs on this device and backend (and
    for ``model``: not one with experts, whose tokens are grouped by expert with sizes
    read on the host)."""
    return device.type == "cuda" and not enforce_eager and attn.name in GRAPH_SAFE_BACKENDS \
        and (model is None or model.spec.moe is None)


@dataclass(slots=True)
class DecodeBuffers:
    """Static inputs of the captured decode graphs; graph ``batch`` reads rows ``[:batch]``."""

    input_ids: torch.Tensor
    """[N] int64."""
    positions: torch.Tensor
    """[N] int64."""
    slot_mapping: torch.Tensor
    """[N] int64, -1 on padding rows."""
    seq_lens: torch.Tensor
    """[N] int32, 1 on padding rows."""
    block_tables: torch.Tensor
    """[N, max_blocks_per_seq] int32."""
    query_start_loc: torch.Tensor
    """[N + 1] int32, ``arange``: one query token per row (never changes)."""

    packed: torch.Tensor
    """uint8: ``input_ids``, ``positions``, ``slot_mapping`` and ``seq_lens`` at the
    offsets :func:`~pagedserve.engine.step_buffers.layout` gives them, then :data:`TAIL_BYTES` for
    the rest of a step's staged arrays: a decode step is staged straight into it, in one
    copy (:meth:`head_arrays`)."""

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device | str) -> DecodeBuffers:
        """Buffers for up to ``max_batch`` rows, every row padding."""
        offsets, head = layout([max_batch * dt.itemsize for dt, _ in _HEAD])
        packed = torch.zeros(head + TAIL_BYTES, dtype=torch.uint8, device=device)
        ids, pos, slots, lens = (packed[o:o + max_batch * dt.itemsize].view(dt)
                                 for o, (dt, _) in zip(offsets, _HEAD, strict=True))  # fmt: skip
        bufs = cls(
            input_ids=ids, positions=pos, slot_mapping=slots, seq_lens=lens,
            block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            packed=packed,
        )
        bufs.pad(0, max_batch)
        return bufs

    def head_arrays(self, input_ids: Sequence[int], positions: Sequence[int],
                    slots: np.ndarray, seq_lens: Sequence[int],
                    ) -> list[tuple[np.ndarray, torch.dtype]]:  # fmt: skip
        """A decode step's rows, padded to every row of the buffers, as the first arrays
        of a staging into :attr:`packed`."""
        out = []
        for values, (dt, pad) in zip((input_ids, positions, slots, seq_lens), _HEAD, strict=True):
            a = np.full(self.max_batch, pad, dtype=NUMPY_DTYPES[dt])
            a[:len(values)] = values
            out.append((a, dt))
        return out

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    def pad(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` padding rows."""
        if end <= start:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.seq_lens[start:end] = 1
        self.block_tables[start:end, 0] = 0

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        padded: int,
    ) -> None:
        """Copy one decode step's ``n`` rows in and pad rows ``[n, padded)``.

        Block-table columns past the step's width keep stale entries: earlier block ids,
        valid indices that no row reads (a row reads only its first ``seq_len`` tokens).
        """
        n = input_ids.shape[0]
        if not 0 < n <= padded <= self.max_batch:
            raise ValueError(f"{n} rows do not fit a padded batch of {padded} "
                             f"(buffers hold {self.max_batch})")  # fmt: skip
        width = min(block_tables.shape[1], self.block_tables.shape[1])
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables[:, :width], non_blocking=True)
        self.pad(n, padded)

    def metadata(
        self, batch: int, max_model_len: int, seq_lens_cpu: list[int] | None = None
    ) -> AttentionMetadata:
        """Metadata over rows ``[:batch]``.

        The host-side lengths are ``max_model_len`` for every row unless
        ``seq_lens_cpu`` is given: a graph-safe backend only sizes its launches from
        them (for the longest context), while the device tensors carry the real lengths.
        """
        lens = [max_model_len] * batch if seq_lens_cpu is None else list(seq_lens_cpu)
        if len(lens) != batch:
            raise ValueError(f"{len(lens)} host lengths for {batch} rows")
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            num_decodes=batch,
            max_query_len=1,
            max_seq_len=max(lens),
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=lens,
        )


class DecodeGraphRunner:
    """Runs decode-only steps on static, padded buffers: replaying captured CUDA graphs,
    or (``use_graphs=False``) the same padded forward pass eagerly, which exercises the
    padding and the fixed launch sizes on any device."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        sizes: Sequence[int],
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"capture sizes must be ascending and distinct, got {sizes}")
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = list(sizes)
        self.device = device
        self.use_graphs = use_graphs
        self.buffers = DecodeBuffers.allocate(
            self.sizes[-1], max_blocks_per_seq(max_model_len, block_size), device
        )
        self.graphs: dict[int, Any] = {}
        """Batch size -> ``torch.cuda.CUDAGraph``."""
        self.outputs: dict[int, torch.Tensor] = {}
        """Batch size -> the graph's static output ``[batch, hidden]``."""
        self.num_replays = 0
        self.num_loads = 0
        """Replays whose inputs were copied in from elsewhere (not staged into the
        buffers: a step with more table changes than :data:`TAIL_BYTES` holds)."""
        self.num_eager_fallbacks = 0

    def _forward(self, batch: int, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
        """The model over buffer rows ``[:batch]`` (host lengths: see
        :meth:`DecodeBuffers.metadata`)."""
        meta = self.buffers.metadata(batch, self.max_model_len, seq_lens_cpu)
        self.attn.prepare(meta, self.block_size)
        b = self.buffers
        return self.model(b.input_ids[:batch], b.positions[:batch], self.kv_caches, meta,
                          self.attn)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per size, largest first, sharing one memory pool; returns
        the seconds taken. Each size runs once eagerly first (kernel compilation and
        allocator warm-up stay out of the graph)."""
        if not self.use_graphs:
            raise RuntimeError("this runner was built with use_graphs=False")
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            self.buffers.pad(0, batch)
            self._forward(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(batch)
            self.graphs[batch] = graph
            self.outputs[batch] = out
        torch.cuda.synchronize(self.device)
        self.buffers.pad(0, self.sizes[-1])
        return time.perf_counter() - t0

    def release(self) -> None:
        """Free the captured graphs (before the communicator their collectives use goes);
        the runner captures nothing after."""
        self.graphs.clear()
        self.outputs.clear()
        self.use_graphs = False

    def batch_for(self, num_reqs: int, num_decodes: int, num_tokens: int,
                  max_seq_len: int) -> int | None:  # fmt: skip
        """The graph size for a step of that shape, or None when it must run eagerly (not
        decode-only, too many requests, or a context past ``max_model_len``)."""
        if num_reqs == 0 or num_decodes != num_reqs or num_tokens != num_reqs:
            return None
        if max_seq_len > self.max_model_len:
            return None
        return padded_batch_size(num_reqs, self.sizes)

    def padded_size(self, step: StepInputs) -> int | None:
        """:meth:`batch_for` of ``step`` (its own ``graph_batch`` when it was staged
        into the buffers)."""
        if step.graph_batch is not None:
            return step.graph_batch
        meta = step.meta
        return self.batch_for(meta.num_reqs, meta.num_decodes, step.input_ids.shape[0],
                              meta.max_seq_len)  # fmt: skip

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` of a decode-only step, or None (run it eagerly).

        With graphs, the result is a view of the graph's static output: valid until the
        next call.
        """
        padded = self.padded_size(step)
        if padded is None:
            self.num_eager_fallbacks += 1
            return None
        meta = step.meta
        n = meta.num_reqs
        if step.graph_batch is None:  # staged elsewhere: copy it in
            self.buffers.load(step.input_ids, step.positions, meta.slot_mapping,
                              meta.seq_lens, meta.block_tables, padded)  # fmt: skip
            self.num_loads += 1
        self.num_replays += 1
        if self.use_graphs:
            self.graphs[padded].replay()
            return self.outputs[padded][:n]
        # Eager: graph-safe backends run exactly what a graph would; others need the real
        # host lengths (padding rows have one token).
        lens = None
        if self.attn.name not in GRAPH_SAFE_BACKENDS:
            lens = list(meta.seq_lens_cpu) + [1] * (padded - n)
        return self._forward(padded, lens)[:n]


def capture_decode_graphs(worker: Any) -> DecodeGraphRunner | None:
    """Capture the decode graphs of ``worker`` (a :class:`pagedserve.engine.worker.worker.Worker` whose
    model runner exists), or None when graphs are off (device, ``enforce_eager``, or a
    backend that cannot be captured). With ``PAGEDSERVE_DECODE_BUFFERS=1`` a runner that
    captures nothing runs decode steps on the padded buffers instead of None.

    Under tensor parallel every rank captures the same sizes in the same order (their
    collectives are in the graphs), and every rank replays or runs eagerly the same
    steps: the choice depends only on the step's description."""
    cfg = worker.config
    sizes = capture_sizes(cfg.max_num_seqs)
    if worker.kv_groups.num_groups > 1:
        if worker.settings.device.type == "cuda" and not cfg.enforce_eager:
            logger.info("CUDA graphs off: the KV cache has %d groups (sliding-window layers), "
                        "each with its own block table", worker.kv_groups.num_groups)
        return None
    if not graphs_wanted(worker.settings.device, cfg.enforce_eager, worker.attn, worker.model):
        if worker.model.spec.moe is not None and worker.settings.device.type == "cuda" \
                and not cfg.enforce_eager:  # fmt: skip
            logger.info("CUDA graphs off: the model's mixture-of-experts layers group each "
                        "step's tokens by expert with sizes read on the host")
        elif worker.settings.device.type == "cuda" and not cfg.enforce_eager:
            logger.info("CUDA graphs off: the %r attention backend cannot be captured "
                        "(graph-safe: %s)", worker.attn.name, sorted(GRAPH_SAFE_BACKENDS))  # fmt: skip
        if not envs.decode_buffers():
            return None
        logger.info("decode steps on the padded graph buffers, without graphs (sizes %s)",
                    sizes)
        return DecodeGraphRunner(worker.model, worker.attn, worker.runner.kv_caches,
                                 cfg.block_size, worker.settings.max_model_len, sizes, worker.settings.device,
                                 use_graphs=False)  # fmt: skip
    runner = DecodeGraphRunner(worker.model, worker.attn, worker.runner.kv_caches,
                               cfg.block_size, worker.settings.max_model_len, sizes, worker.settings.device)  # fmt: skip
    before = torch.cuda.memory_reserved(worker.settings.device)
    seconds = runner.capture()
    used = torch.cuda.memory_reserved(worker.settings.device) - before
    logger.info("captured %d decode CUDA graphs in %.2fs (batch sizes %s; max context %d; "
                "%.1f MiB reserved)", len(sizes), seconds, sizes, worker.settings.max_model_len, used / 2**20)  # fmt: skip
    return runner
