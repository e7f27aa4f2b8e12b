"""A snapshot of the KV cache for the live block map: the pool, the requests, counters.

Taken on the thread that owns the scheduler, between steps (never while a step mutates
the block manager): :class:`pagedserve.engine.loop.async_engine.AsyncEngine` takes it when the event loop
asks for it. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.blockmgr.snapshot import Run, encode_blocks, summarize, summarize_marks, table_runs
from pagedserve.engine.core.request import Request
from pagedserve.engine.core.scheduler import Scheduler

DEFAULT_MAX_CELLS = 2048
"""Cells in a snapshot unless asked otherwise: a pool with more blocks is summarized."""
MAX_CELLS_LIMIT = 1 << 20


@dataclass(slots=True)
class KVRequestState:
    """One unfinished request as the block map shows it."""

    request_id: str
    status: str
    """``waiting``, ``running``, ``preempted``, ``waiting_for_grammar`` or
    ``waiting_for_kv_load``."""
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache at its first admission."""
    num_blocks: int
    block_runs: list[Run] | None
    """Its block table as ``(first, count)`` runs (None when tables were not asked for)."""


@dataclass(slots=True)
class KVState:
    """The pool (see :mod:`pagedserve.blockmgr.snapshot` for the cell bytes), requests and counters."""

    time: float
    num_blocks: int
    block_size: int
    prefix_caching: bool
    cells: bytes
    blocks_per_cell: int
    loaded_cells: bytes
    """One byte per cell: 1 where a block of the cell holds bytes read back from the KV
    store (:mod:`pagedserve.engine.kvstore`) instead of computed."""
    requests: list[KVRequestState]
    counters: dict[str, float]


class KVStateTaker:
    """Takes snapshots, keeping each live request's block-table runs between them: a
    table only grows until it is freed, so a snapshot encodes only the blocks added since
    the one before (a freed and re-allocated table is a new list, encoded afresh)."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[list[int], int, list[Run]]] = {}

    def take(self, sched: Scheduler, now: float, max_cells: int = DEFAULT_MAX_CELLS,
             tables: bool = True, totals: dict[str, int] | None = None) -> KVState:
        """The scheduler's KV cache as it is now; call it only between steps.

        ``totals`` (e.g. prompt and generation token totals) are copied into the counters.
        """
        kv = sched.kv
        encoded = encode_blocks(kv.pool)
        num_cached_free = encoded.count(1)  # ref count 0, keyed
        cells, per = summarize(encoded, max_cells)
        loaded = kv.pool.loaded
        stats = kv.stats()
        reqs = [*sched.running, *sched.waiting, *sched.waiting_for_grammar.values(),
                *sched.waiting_for_kv_load.values()]
        counters: dict[str, float] = {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_used_blocks": stats.num_used_blocks,
            "num_free_blocks": stats.num_free_blocks - num_cached_free,
            "num_cached_free_blocks": num_cached_free,
            "num_cached_blocks": stats.num_cached_blocks,
            "kv_waste": stats.waste,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_hit_rate": stats.hit_rate,
            "num_preemptions": sched.num_preemptions,
            "num_kv_groups": kv.num_groups,
            "num_loaded_blocks": loaded.count(1),
            **(totals or {}),
        }
        states = [self._request_state(sched, r, tables) for r in reqs]
        if tables and len(self._runs) > len(reqs):
            live = {r.request_id for r in reqs}
            self._runs = {rid: v for rid, v in self._runs.items() if rid in live}
        return KVState(
            time=now, num_blocks=kv.num_blocks, block_size=kv.block_size,
            prefix_caching=kv.enable_prefix_caching, cells=cells, blocks_per_cell=per,
            loaded_cells=summarize_marks(loaded, per), requests=states, counters=counters)

    def _request_state(self, sched: Scheduler, req: Request, tables: bool) -> KVRequestState:
        rid = req.request_id
        kv = sched.kv
        table = kv.get_block_table(rid)
        runs = None
        if tables and kv.num_groups > 1:
            # every group's blocks, group 0's first; a sliding table changes below its
            # window, so its runs are made afresh
            null = kv.null_block
            runs = table_runs([b for t in kv.get_block_tables(rid) for b in t if b != null])
        elif tables:
            kept = self._runs.get(rid)
            if kept is not None and kept[0] is table and len(table) >= kept[1]:
                runs = table_runs(table, kept[2], kept[1])
            else:
                runs = table_runs(table)
            self._runs[rid] = (table, len(table), runs)
            runs = list(runs)  # the snapshot's own copy: the kept runs grow later
        return KVRequestState(
            request_id=rid, status=req.status.name.lower(), num_tokens=req.num_tokens,
            num_computed_tokens=req.num_computed_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_blocks=kv.num_allocated_blocks(rid),
            block_runs=runs)


def take_kv_state(sched: Scheduler, now: float, max_cells: int = DEFAULT_MAX_CELLS,
                  tables: bool = True, totals: dict[str, int] | None = None) -> KVState:
    """One snapshot without kept runs (see :meth:`KVStateTaker.take`)."""
    return KVStateTaker().take(sched, now, max_cells, tables, totals)
