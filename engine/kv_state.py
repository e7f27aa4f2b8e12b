"""A snapshot of the KV cache for the live block map: the pool, the requests, counters.

Taken on the thread that owns the scheduler, between steps (never while a step mutates
the block manager): :class:`engine.async_engine.AsyncEngine` takes it when the event loop
asks for it. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockmgr.snapshot import encode_blocks, summarize, table_runs
from engine.request import Request
from engine.scheduler import Scheduler

DEFAULT_MAX_CELLS = 2048
"""Cells in a snapshot unless asked otherwise: a pool with more blocks is summarized."""
MAX_CELLS_LIMIT = 1 << 20


@dataclass(slots=True)
class KVRequestState:
    """One unfinished request as the block map shows it."""

    request_id: str
    status: str
    """``waiting``, ``running``, ``preempted`` or ``waiting_for_grammar``."""
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache at its first admission."""
    num_blocks: int
    block_runs: list[list[int]] | None
    """Its block table as ``[first, count]`` runs (None when tables were not asked for)."""


@dataclass(slots=True)
class KVState:
    """The pool (see :mod:`blockmgr.snapshot` for the cell bytes), requests and counters."""

    time: float
    num_blocks: int
    block_size: int
    prefix_caching: bool
    cells: bytes
    blocks_per_cell: int
    requests: list[KVRequestState]
    counters: dict[str, float]


def _request_state(sched: Scheduler, req: Request, tables: bool) -> KVRequestState:
    table = sched.kv.get_block_table(req.request_id)
    return KVRequestState(
        request_id=req.request_id, status=req.status.name.lower(),
        num_tokens=req.num_tokens, num_computed_tokens=req.num_computed_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0), num_blocks=len(table),
        block_runs=table_runs(table) if tables else None)  # fmt: skip


def take_kv_state(sched: Scheduler, now: float, max_cells: int = DEFAULT_MAX_CELLS,
                  tables: bool = True, totals: dict[str, int] | None = None) -> KVState:
    """The scheduler's KV cache as it is now; call it only between steps.

    ``totals`` (e.g. prompt and generation token totals) are copied into the counters.
    """
    kv = sched.kv
    encoded = encode_blocks(kv.pool)
    num_cached_free = encoded.count(1)  # ref count 0, keyed
    cells, per = summarize(encoded, max_cells)
    stats = kv.stats()
    reqs = [*sched.running, *sched.waiting, *sched.waiting_for_grammar.values()]
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
        **(totals or {}),
    }
    return KVState(
        time=now, num_blocks=kv.num_blocks, block_size=kv.block_size,
        prefix_caching=kv.enable_prefix_caching, cells=cells, blocks_per_cell=per,
        requests=[_request_state(sched, r, tables) for r in reqs], counters=counters)
