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

Under ``scheduling_policy="priority"`` "oldest" reads "first by (priority, arrival)":
the waiting queue and the running list are kept in that order, so the step serves the
most urgent first and preempts the least urgent first. A waiting request that outranks
the least urgent running one, and finds no seat (``max_num_seqs``) or not the blocks for
its first chunk, preempts it before the step is scheduled. The most urgent running
request is never a victim; a request of low priority may wait as long as more urgent
ones keep arriving.

The step contract: the scheduler owns the :class:`KVCacheManager` and every request's
state. :meth:`Scheduler.schedule` returns a :class:`SchedulerOutput` of plain data (what
the model side needs, as diffs against what it was sent before);
:meth:`Scheduler.update_from_output` applies a step's result: computed-token counts,
sampled tokens, the stops that need no text (EOS, stop token ids, length), finishing
and freeing blocks. Stop strings need the detokenized text: the output processor finds
them and calls :meth:`Scheduler.finish_request`.

With a KV block store (``kv_store``) the pool gets a lower tier
(:mod:`pagedserve.engine.core.kv_tier`): a request whose prompt goes on in the store past
its pool hit waits in ``waiting_for_kv_load`` while the blocks are read, and each step's
output names the blocks to copy between the pool and the store.

Imports no torch.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from pagedserve.blockmgr import KVCacheManager
from pagedserve.blockmgr.groups import KVGroups
from pagedserve.engine.core.kv_tier import BlockStore, StoreTier
from pagedserve.engine.core.lora_slots import LoRAGate, active_loras, lora_gate, lora_victims
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SampledToken,
    SchedulerOutput,
    SpecStats,
)
from pagedserve.engine.core.waiting_queue import WaitingQueue, priority_key
from pagedserve.engine.speculative import SpeculativeConfig

logger = logging.getLogger("pagedserve.engine.core.scheduler")


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        speculative_config: SpeculativeConfig | None = None,
        scheduling_policy: str = "fcfs",
        max_loras: int = 0,
        kv_groups: KVGroups | None = None,
        kv_store: BlockStore | None = None,
        kv_store_write_through: bool = False,
    ) -> None:
        self.store_tier = None if kv_store is None else StoreTier(kv_store, kv_store_write_through)
        """The KV block store below the pool, or None."""
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, kv_groups,
                                 self.store_tier)  # fmt: skip
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # Admitting a new request leaves this many blocks free, so that running
        # requests can grow a little before anyone is preempted.
        self.num_watermark_blocks = int(watermark * num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduling_policy)
        self.running: list[Request] = []
        self.waiting_for_grammar: dict[str, Request] = {}
        """Requests whose grammar is compiling: skipped until :meth:`grammar_ready`."""
        self.waiting_for_kv_load: dict[str, Request] = {}
        """Requests whose blocks the KV store reads: skipped until the load is done."""
        self.num_preemptions = 0
        self.max_loras = max_loras
        """Distinct LoRA adapters a step may hold (0: no limit, no adapters)."""
        self._gate: LoRAGate | None = None  # the step's (set by schedule())
        self.speculative = speculative_config
        self.spec_stats = SpecStats()
        self.ended_without_tokens: list[Request] = []
        """Requests with ``max_tokens=0`` that ended once their prompt was computed (the
        engine reports them; no token of theirs was appended)."""
        self._finished_ids: list[str] = []
        """Finished since the last schedule(): the model side drops their state."""

    # -- queues ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; one in ``WAITING_FOR_GRAMMAR`` waits for :meth:`grammar_ready`."""
        self.requests[req.request_id] = req
        if req.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar[req.request_id] = req
        else:
            self.waiting.add(req)

    def grammar_ready(self, req: Request) -> None:
        """Its grammar compiled: the request joins the waiting queue (arrival order among
        those that arrive later)."""
        if self.waiting_for_grammar.pop(req.request_id, None) is not None:
            req.status = RequestStatus.WAITING
            self.waiting.add(req)

    def _poll_kv_loads(self) -> None:
        """Requests whose store load is done join the waiting queue again, at the place a
        preempted request takes (they had reached the head once)."""
        tier = self.store_tier
        done = [r for rid, r in self.waiting_for_kv_load.items() if tier.load_done(rid)]
        for req in reversed(done):
            del self.waiting_for_kv_load[req.request_id]
            req.status = RequestStatus.WAITING
            self.waiting.put_back(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_grammar) + len(self.waiting_for_kv_load)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar
                    or self.waiting_for_kv_load)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Mark a request finished (or aborted) and return its blocks to the pool."""
        if req.status.finished:
            return
        if self.waiting_for_grammar.pop(req.request_id, None) is not None:
            req.status = status
            self.requests.pop(req.request_id, None)
            return
        if self.store_tier is not None:
            self.store_tier.forget(req.request_id)
        # A request waiting for a store load holds no blocks, but may have run before a
        # preemption: the runner is told below.
        loading = self.waiting_for_kv_load.pop(req.request_id, None) is not None
        queue = self.waiting if req.status in (RequestStatus.WAITING,
                                               RequestStatus.PREEMPTED) else self.running
        req.status = status
        try:
            if not loading:
                queue.remove(req)
        except ValueError:
            pass
        # An errored request's KV is not trusted (non-finite values, a failed step): its
        # blocks leave the prefix cache.
        self.kv.free(req, keep_cached=status is not RequestStatus.FINISHED_ERROR)
        self.requests.pop(req.request_id, None)
        if req.runner_knows:
            self._finished_ids.append(req.request_id)
            req.runner_knows = False

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: list[tuple[Request, int]] = []
        if self.waiting_for_kv_load:
            self._poll_kv_loads()
        self._gate = lora_gate(self.waiting, self.running, self.max_loras) if self.max_loras else None
        if self.waiting.by_priority:
            self.running.sort(key=priority_key)
            self._preempt_for_priority(out)
        num_preempted = len(out.preempted_req_ids)
        budget = self._schedule_running(scheduled, out)
        if len(out.preempted_req_ids) == num_preempted:  # blocks did not run out
            self._admit_waiting(scheduled, budget)
        for req, n in scheduled:
            out.num_scheduled_tokens[req.request_id] = n
            self._describe(req, out)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if scheduled:  # an empty step is not run: the finished ids wait for the next one
            out.finished_req_ids, self._finished_ids = self._finished_ids, []
        if self.store_tier is not None:
            out.blocks_to_save, out.blocks_to_load, out.blocks_to_write = \
                self.store_tier.take_transfers(self.kv)
        return out

    def _schedule_running(self, scheduled: list[tuple[Request, int]],
                          out: SchedulerOutput) -> int:
        """Running requests, oldest first, each its next token or chunk (a decode with
        its draft tokens, when speculating); returns the token budget left. Preempts from
        the newest when blocks run out."""
        budget = self.max_num_batched_tokens
        preempted = out.preempted_req_ids
        speculate = self.speculative is not None and len(self.running) <= self.speculative.disable_by_batch_size
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (should not happen); keep it running
                idx += 1
                continue
            drafts, req.spec_token_ids = req.spec_token_ids, []
            if speculate and drafts and num_new == 1:
                drafts = drafts[:self._max_drafts(req, budget - 1)]
                # Blocks for the drafts, or none: drafts never cost a preemption.
                if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                    out.scheduled_spec_decode_tokens[req.request_id] = drafts
                    scheduled.append((req, 1 + len(drafts)))
                    budget -= 1 + len(drafts)
                    idx += 1
                    continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, preempted)
                if victim is req:
                    return budget  # req preempted itself: it was the last running request
            scheduled.append((req, num_new))
            budget -= num_new
            idx += 1
        return budget

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Waiting requests, first first, take the places of the least urgent running ones they
        outrank when they find no seat or blocks for their first chunk (hits not counted)."""
        seats, free, gate = len(self.running), self.kv.num_free_blocks, self._gate
        for head in list(itertools.islice(self.waiting, self.max_num_seqs)):
            if gate is not None and gate.closed_to(head):
                continue  # the step admits none of its adapter: no place is made for it
            if gate is not None and not gate.admits(head, active_loras(self.running)):
                victims = lora_victims(head, self.running)  # its adapter's place
                if not victims:
                    continue
                for low in victims:
                    self._preempt(low, out.preempted_req_ids)
                seats, free = len(self.running), self.kv.num_free_blocks
            need = self.kv.num_new_blocks_for(min(head.num_tokens, self.max_num_batched_tokens))
            while seats >= self.max_num_seqs or free - need < self.num_watermark_blocks:
                low = self.running[-1] if self.running else None
                if low is None or low.params.priority <= head.params.priority:
                    return
                self._preempt(low, out.preempted_req_ids)
                seats, free = seats - 1, self.kv.num_free_blocks
            seats, free = seats + 1, free - need

    def _max_drafts(self, req: Request, budget: int) -> int:
        """Drafts a decode may verify: within the step's budget, and so that accepting all
        of them and one more token stays within ``max_tokens`` and the context."""
        return max(0, min(budget, req.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int) -> None:
        kv, gate, active = self.kv, self._gate, active_loras(self.running)
        admits = None if gate is None else (lambda r: gate.admits(r, active))
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.first(admits)
            if req is None:
                break
            computed_blocks: list[int] = []
            num_cached = 0
            # Prompt logprobs need every prompt token computed (the first sibling's), until
            # they are all in (a request preempted after that may hit the cache).
            whole = req.index == 0 and req.group.needs_whole_prompt
            if req.num_computed_tokens == 0 and not whole:
                hit = self._prefix_hit(req)
                if hit is None:
                    continue
                computed_blocks, num_cached = hit
            num_new = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            num_needed = kv.num_new_blocks_for(num_cached + num_new, len(computed_blocks))
            if kv.num_free_blocks - num_needed < self.num_watermark_blocks and self.running:
                break
            forked = 0 if computed_blocks or whole else self._fork_from_sibling(req, scheduled)
            if forked:
                num_cached = req.num_computed_tokens = forked
                num_new = min(req.num_tokens - forked, budget)
            if not kv.allocate_slots(req, num_new, computed_blocks or None):
                if forked:
                    kv.free(req)
                    req.num_computed_tokens = 0
                break
            self.waiting.remove(req)
            if gate is not None:
                gate.admitted(req, active)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

    def _prefix_hit(self, req: Request) -> tuple[list[int], int] | None:
        """The request's prefix-cache hit, with the blocks its finished store load read
        placed in the pool first; None when the store holds more of its chain: the
        request leaves the queue to wait for those blocks."""
        tier, kv = self.store_tier, self.kv
        if tier is not None:
            tier.place(kv, req)
        computed_blocks, num_cached = kv.get_computed_blocks(req)
        if tier is None or not tier.start_load(kv, req, len(computed_blocks)):
            return computed_blocks, num_cached
        # Looked up again (and counted then) when the load is done.
        kv.num_prefix_cache_queries -= len(req.all_token_ids)
        kv.num_prefix_cache_hits -= num_cached
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_KV_LOAD
        self.waiting_for_kv_load[req.request_id] = req
        return None

    def take_kv_saves(self) -> list[tuple[bytes, int]]:
        """Blocks evicted outside a step (:meth:`KVCacheManager.reset_prefix_cache`) whose
        bytes the engine saves now, before any step reuses them."""
        return [] if self.store_tier is None else self.store_tier.take_saves()

    def _fork_from_sibling(self, req: Request, scheduled: list[tuple[Request, int]]) -> int:
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
            filled = sib.num_computed_tokens + next((n for r, n in scheduled if r is sib), 0)
            limit = min(filled, req.num_prompt_tokens - 1)
            if limit >= self.kv.block_size:
                return self.kv.fork(sib, req, limit)
        return 0

    def _describe(self, req: Request, out: SchedulerOutput) -> None:
        """What the model side needs of a scheduled request: all of it the first time,
        else the tokens and blocks added since it was last sent."""
        table, *others = self.kv.get_block_tables(req.request_id)
        if not req.runner_knows:
            out.new_requests.append(NewRequestData(
                req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids, params=req.params,
                sample_index=req.index, block_ids=list(table),
                num_computed_tokens=req.num_computed_tokens,
                lora_request=req.lora_request, pooling=req.group.pooling,
                other_block_ids=[list(t) for t in others]))  # fmt: skip
            req.runner_knows = True
        else:
            sent = req.num_sent_blocks
            out.cached_requests.append(CachedRequestData(
                req_id=req.request_id, new_token_ids=req.all_token_ids[req.num_sent_tokens:],
                new_block_ids=table[sent:], num_computed_tokens=req.num_computed_tokens,
                other_block_ids=[t[sent:] for t in others]))  # fmt: skip
        req.num_sent_tokens = req.num_tokens
        req.num_sent_blocks = len(table)

    def _preempt(self, req: Request, preempted: list[str]) -> None:
        """Free its blocks and queue it to be recomputed; its id goes to ``preempted``."""
        preempted.append(req.request_id)
        self.running.remove(req)
        self.kv.free(req)
        if self.store_tier is not None:
            self.store_tier.forget(req.request_id)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_sent_blocks = 0  # its next description carries the whole new table
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.put_back(req)
        logger.info(
            "preempted request %s (%d tokens, preemption #%d); it will be recomputed",
            req.request_id, req.num_tokens, req.metrics.num_preemptions,
        )

    # -- after the forward ----------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           output: ModelRunnerOutput | None) -> list[SampledToken]:
        """Apply a step's result: computed tokens (less the rejected drafts), then each
        sampled token in order with the stops that need no text (EOS and stop token ids
        once ``min_tokens`` are out, ``max_tokens``, the context length), finishing and
        freeing blocks; tokens after a stop are dropped."""
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is not None:
                req.num_computed_tokens += n
        if output is None:
            return []
        appended: list[SampledToken] = []
        scheduled_drafts = sched.scheduled_spec_decode_tokens
        for rid, tokens, logprobs in zip(output.req_ids, output.sampled_token_ids,
                                         output.logprobs, strict=True):  # fmt: skip
            req = self.requests.get(rid)
            if req is None or req.status.finished or rid in output.errors:
                continue
            drafts = scheduled_drafts.get(rid)
            if drafts:
                self._count_accepted(req, len(drafts), len(tokens) - 1)
            self._append(req, tokens, logprobs, appended)
            if not req.status.finished:
                req.spec_token_ids = output.spec_token_ids.get(rid, [])
        return appended

    def _count_accepted(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Rejected drafts were computed but are not the request's: uncount them (their
        slots are written again by the tokens that replace them)."""
        req.num_computed_tokens -= num_drafts - num_accepted
        st = self.spec_stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted

    def _append(self, req: Request, tokens: list[int], logprobs: list | None,
                appended: list[SampledToken]) -> None:
        if req.max_tokens == 0:  # the prompt is computed; nothing is to be generated
            self.finish_request(req, RequestStatus.FINISHED_LENGTH)
            self.ended_without_tokens.append(req)
            return
        for j, token in enumerate(tokens):
            req.all_token_ids.append(token)
            status = self._check_stop_token(req, token)
            stopped = status is not None
            if status is None and (req.num_output_tokens >= req.max_tokens
                                   or req.num_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            appended.append(SampledToken(req, token, None if logprobs is None else logprobs[j],
                                         stopped, req.num_output_tokens))  # fmt: skip
            if status is not None:
                self.finish_request(req, status)
                return

    @staticmethod
    def _check_stop_token(req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens < p.min_tokens:
            return None
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def fail_requests(self, req_ids: Iterable[str]) -> None:
        """A failed forward: its requests end with an error; blocks the step registered
        in the prefix cache were never written and are dropped."""
        for rid in list(req_ids):
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(req, RequestStatus.FINISHED_ERROR)
        self.kv.drop_unreferenced_cache()
