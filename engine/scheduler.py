"""Continuous batching with chunked prefill over a paged KV cache.

There is no prefill phase and decode phase: every request has ``num_computed_tokens``
that catches up with its token count. Each step has a token budget
(``max_num_batched_tokens``): running requests first, oldest admission first (one
token each when decoding, the next chunk when still prefilling), then waiting
requests in arrival order, each cut to what the budget leaves. When blocks run out,
the most recently admitted running request is preempted (blocks freed, recomputed
later; it goes back to the head of the waiting queue). The oldest running request is
never a victim, so every request eventually becomes the oldest and finishes: none is
preempted forever.

Imports no torch: the scheduler sees the KV cache only through ``KVCacheManager``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from blockmgr import KVCacheManager
from engine.request import Request, RequestStatus

logger = logging.getLogger("engine.scheduler")


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """(request, number of tokens computed this step), in scheduling order."""
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Admitting a new request leaves this many blocks free, so that running
        # requests can grow a little before anyone is preempted.
        self.num_watermark_blocks = int(watermark * kv.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._admit_seq = 0

    # -- queues ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark a request finished (or aborted) and return its blocks to the pool."""
        if req.status.finished:
            return
        was_waiting = req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        req.status = status
        if was_waiting:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        else:
            try:
                self.running.remove(req)
            except ValueError:
                pass
        self.kv.free(req)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (should not happen); keep it running
                idx += 1
                continue
            while not kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new
                idx += 1
                continue
            break  # req preempted itself: it was the last running request

        if not out.preempted:
            self._admit_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed_blocks: list[int] = []
            num_cached = 0
            forked = 0
            if req.num_computed_tokens == 0:
                computed_blocks, num_cached = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            num_needed = -(-(num_cached + num_new) // kv.block_size) - len(computed_blocks)
            if kv.num_free_blocks - num_needed < self.num_watermark_blocks and self.running:
                break
            if not computed_blocks:
                forked = self._fork_from_sibling(req, out)
                if forked:
                    num_cached = forked
                    req.num_computed_tokens = forked
                    num_new = min(req.num_tokens - forked, budget)
            if not kv.allocate_slots(req, num_new, computed_blocks or None):
                if forked:
                    kv.free(req)
                    req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self._admit_seq += 1
            req.admit_seq = self._admit_seq
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new

    def _fork_from_sibling(self, req: Request, out: SchedulerOutput) -> int:
        """With prefix caching off, share a running sibling's full prompt blocks."""
        if self.kv.enable_prefix_caching or len(req.group.members) < 2:
            return 0
        if req.num_tokens != req.num_prompt_tokens:
            return 0
        for sib in req.group.members:
            if sib is req or sib.status is not RequestStatus.RUNNING:
                continue
            # Tokens the sibling has computed, or computes in this step: K/V of a step is
            # written before any attention in that step reads it.
            filled = sib.num_computed_tokens + next(
                (n for r, n in out.scheduled if r is sib), 0)
            limit = min(filled, req.num_prompt_tokens - 1)
            if limit >= self.kv.block_size:
                return self.kv.fork(sib, req, limit)
        return 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info(
            "preempted request %s (%d tokens, preemption #%d); it will be recomputed",
            req.request_id, req.num_tokens, req.num_preemptions,
        )
