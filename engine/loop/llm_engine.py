"""``LLMEngine``: the engine core shared by the offline ``LLM`` and the server.

``add_request`` validates and queues; ``step`` runs one step as schedule -> execute ->
update -> process outputs and returns the outputs of the requests that progressed. The
engine is single-threaded: the server drives it from its own engine thread, the
offline API from the caller's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from concurrent import futures
from dataclasses import dataclass, field

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.lora_slots import lora_names
from pagedserve.engine.core.outputs import RequestOutput
from pagedserve.engine.core.pooling import PoolingParams, pooling_defaults
from pagedserve.engine.core.request import Request, RequestGroup, RequestStatus
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.errors import (
    EngineFatalError,
    EngineInputError,
    InputField,
    LoRAError,
    StructuredOutputsError,
)
from pagedserve.engine.loop.engine_info import EngineInfo, InputLimits, generation_defaults
from pagedserve.engine.loop.store_link import EngineKVStore
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.output.detokenizer import IncrementalDetokenizer
from pagedserve.engine.output.processor import OUTPUT_DELTA, OUTPUT_FINAL, OutputProcessor
from pagedserve.engine.output.stop import StopChecker
from pagedserve.engine.sample.penalties import bad_word_sequences
from pagedserve.engine.worker import process_tuning
from pagedserve.engine.worker.settings import resolve_settings
from pagedserve.engine.worker.worker import Worker

logger = logging.getLogger("pagedserve.engine")

__all__ = ["OUTPUT_DELTA", "OUTPUT_FINAL", "EngineStats", "LLMEngine", "StepStats"]

KV_STORE_STATS_S = 0.5
"""How old the KV store's counters in :meth:`LLMEngine.stats` may be while the engine side
of the store did nothing new (reading the store's counters takes about 0.1 ms, and the
server takes the engine's statistics after every step)."""


@dataclass(slots=True)
class StepStats:
    """One step, as :meth:`LLMEngine.step` ran it."""

    num_tokens: int
    """Tokens computed (prompt chunks and decodes)."""
    num_requests: int
    num_decodes: int
    """Requests that computed one token."""
    num_sampled: int
    """Requests that sampled a token."""
    schedule_s: float
    execute_s: float
    """The forward pass and sampling."""
    output_s: float
    """Updating the requests and building the outputs."""
    num_context_tokens: int = 0
    """Tokens of context the step's attention reads: each scheduled request's computed
    tokens and the ones it computed this step."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_num_drafts: int = 0
    """Request-steps that verified draft tokens (speculative decoding)."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    loras: dict = field(default_factory=dict)
    """The running and waiting adapters (:func:`pagedserve.engine.core.lora_slots.lora_names`)."""
    kv_store: dict[str, int] = field(default_factory=dict)
    """The KV block store's counters (empty without one): the scheduler's ``tier_*``
    (:class:`~pagedserve.engine.core.kv_tier.StoreTierStats`), the store's ``store_*`` and
    each tier's ``memory_*`` / ``disk_*``."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tuning = process_tuning.apply()
        """The process tuning in effect (logged at start)."""
        self.settings = settings = resolve_settings(config)
        """The settings resolved once, before the worker: what every part reads."""
        self.worker = Worker(settings)
        w = self.worker
        self.kv_store = EngineKVStore.open(w)
        """The KV block store below the prefix cache, or None (:mod:`.store_link`)."""
        self._kv_store_seen: tuple[float, object, dict[str, int]] = (0.0, None, {})
        self.tokenizer = w.tokenizer
        self.token_text = functools.lru_cache(maxsize=65536)(self._decode_token)
        """One token's text decoded alone (cached); logprobs show it."""
        self.scheduler = Scheduler(
            w.num_blocks, settings.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            speculative_config=config.speculative_config,
            scheduling_policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else 0,
            kv_groups=w.kv_groups,
            kv_store=None if self.kv_store is None else self.kv_store.store,
            kv_store_write_through=config.kv_store_write_through,
        )  # fmt: skip
        self.limits = InputLimits(
            vocab_size=settings.vocab_size, max_model_len=settings.max_model_len,
            num_kv_blocks=w.num_blocks, block_size=settings.block_size,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            hidden_size=settings.decoder.hidden_size,
            kv_groups=w.kv_groups if w.kv_groups.sliding else None)  # fmt: skip
        self.info = EngineInfo(
            model_name=settings.model_name, model_path=str(settings.model_path),
            tokenizer=w.tokenizer, eos_token_ids=tuple(w.eos_token_ids),
            max_num_seqs=config.max_num_seqs, limits=self.limits,
            generation_defaults=generation_defaults(settings.model_path),
            lora=None if w.loras is None else w.loras.limits,
            pooling_defaults=pooling_defaults(settings.model_path))  # fmt: skip
        """What front ends read of the engine."""
        self.output = OutputProcessor(self.token_text, self.tokenizer)
        self._counter = itertools.count()
        self.structured = w.structured
        """Compiles structured-output grammars in its own threads."""
        self._compiling: dict[str, tuple[RequestGroup, futures.Future]] = {}
        if w.loras is not None:  # live requests' adapters stay loaded
            w.loras.in_use = lambda: {r.lora_int_id for r in self.scheduler.requests.values()}
        self.num_prompt_tokens_total = 0
        self.last_step: StepStats | None = None
        """The statistics of the latest step that ran (benchmarks read them)."""
        self.needs_self_check = False
        """Set when a forward pass failed: a driver should run :meth:`self_check_request`
        to completion before it takes new work."""

    @property
    def kv(self):
        """The scheduler's :class:`blockmgr.KVCacheManager` (read-only use: stats)."""
        return self.scheduler.kv

    @property
    def num_generation_tokens_total(self) -> int:
        return self.output.num_generation_tokens_total

    @property
    def finished_by_reason(self) -> dict[str, int]:
        return self.output.finished_by_reason

    # -- requests -----------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._counter)}"

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's resolved token limit (see :meth:`InputLimits.resolve_max_tokens`);
        raises :class:`~pagedserve.engine.errors.PromptTooLongError`."""
        return self.limits.resolve_max_tokens(num_prompt_tokens, params)

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        output_kind: str = OUTPUT_FINAL,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> RequestGroup:
        """Validate and queue a request (its ``n`` sequences); an EngineInputError names
        the field at fault. ``pooling``: an embedding request (``max_tokens=0``; its
        output's ``embedding`` is its prompt's pooled vector)."""
        request_id = request_id or self.new_request_id()
        if request_id in self.output.groups:
            raise EngineInputError(f"request_id={request_id!r} is already in use",
                                   InputField.REQUEST_ID)  # fmt: skip
        self._prepare(params)
        self._check_lora(lora_request)
        limits = self.limits
        limits.check_token_ids(prompt_token_ids)
        limits.check_sampling_token_ids(params)
        max_tokens = limits.resolve_max_tokens(len(prompt_token_ids), params)
        constraint = params.structured_outputs
        now = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), params, now)
        if pooling is not None:
            group.pooling = pooling.resolved(self.info.pooling_defaults, limits.hidden_size, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = []
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                group=group,
                index=i,
                params=params,
                prompt_token_ids=group.prompt_token_ids,
                max_tokens=max_tokens,
                eos_token_ids=self.info.eos_token_ids,
                cache_salt=cache_salt,
                lora_request=lora_request,
                arrival_time=now,
            )
            req.detok = IncrementalDetokenizer(
                self.tokenizer, group.prompt_token_ids, params.skip_special_tokens,
                params.spaces_between_special_tokens)
            req.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
            group.members.append(req)
        if constraint is not None:
            # Compiled in the manager's threads; the requests wait in their own state.
            self._compiling[request_id] = (group, self.structured.submit(constraint))
            for req in group.members:
                req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.output.add(group, output_kind)
        for req in group.members:
            self.scheduler.add_request(req)
        self.num_prompt_tokens_total += len(prompt_token_ids)
        return group

    def _prepare(self, params: SamplingParams) -> None:
        """What the engine's configuration rules out (a priority under fcfs, structured
        outputs with speculative decoding); ``bad_words`` as token sequences."""
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_word_sequences(self.tokenizer, params.bad_words)
        if params.priority and self.config.scheduling_policy != "priority":
            raise EngineInputError(
                f"priority={params.priority} is invalid: this engine schedules first come, "
                "first served (scheduling_policy='fcfs'); start it with "
                "scheduling_policy='priority'", InputField.PRIORITY)
        if params.structured_outputs is not None and self.config.speculative_config is not None:
            raise StructuredOutputsError(
                "structured_outputs cannot be combined with speculative decoding, which "
                "this engine was started with (speculative_config)")

    def _check_lora(self, lora: LoRARequest | None) -> None:
        """An adapter request needs LoRA enabled, and an adapter that loads and fits the
        model (loaded now, so that a bad one fails its request alone)."""
        if lora is None:
            return
        if self.worker.loras is None:
            raise EngineInputError(f"lora_request names adapter {lora.lora_name!r} but this "
                                   "engine was started without enable_lora",
                                   InputField.LORA_REQUEST)  # fmt: skip
        try:
            self.worker.loras.get(lora)
        except LoRAError as e:
            raise EngineInputError(str(e), InputField.LORA_REQUEST) from None

    def self_check_request(self) -> str:
        """Queue a one-token greedy request that checks the model still steps after a
        failed forward pass; its id (it ends ``"length"``, or ``"error"`` if the step
        fails again)."""
        self.needs_self_check = False
        group = self.add_request(
            f"self-check-{self.new_request_id()}", [0],
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        return group.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request wherever it is; its blocks return to the pool at once."""
        group = self.output.groups.get(request_id)
        if group is None:
            return None
        self._compiling.pop(request_id, None)
        self._finish(group.members, RequestStatus.FINISHED_ABORTED)
        return self.output.make_output(group, force=True)

    def retire_lora(self, lora_int_id: int) -> None:
        """An adapter is no longer served (unloaded by name): its weights are freed once
        no live request uses them."""
        if self.worker.loras is not None:
            self.worker.loras.retire(lora_int_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, reqs: list[Request], status: RequestStatus) -> None:
        for req in reqs:
            self.scheduler.finish_request(req, status)
            self.output.count_finished(req)

    # -- one step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update -> process outputs."""
        t0 = time.perf_counter()
        failed = self._poll_grammars() if self._compiling else []
        sched = self.scheduler.schedule()
        if self.kv_store is not None and sched.moves_blocks:
            self.kv_store.before_forward(sched)
        if sched.is_empty:
            self._idle(bool(failed))
            return failed
        requests = self.scheduler.requests
        now = time.monotonic()
        for rid in sched.num_scheduled_tokens:
            m = requests[rid].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        t1 = time.perf_counter()
        try:
            result = self.worker.execute(sched)
        except EngineFatalError:
            raise
        except Exception:
            logger.exception("model step failed; failing the %d requests in it",
                             len(sched.num_scheduled_tokens))
            self.needs_self_check = True
            reqs = [requests[rid] for rid in sched.num_scheduled_tokens]
            self.scheduler.fail_requests(sched.num_scheduled_tokens)
            groups = {r.group.request_id: r.group for r in reqs}
            for req in reqs:
                self.output.count_finished(req)
            return [self.output.make_output(g, force=True) for g in groups.values()]
        t2 = time.perf_counter()
        if result is not None and result.prompt_logprobs:  # before a request finishes
            failed += self.output.add_prompt_logprobs(result.prompt_logprobs)
            self._finish_ended()
        for rid, vec in () if result is None else result.pooled.items():
            requests[rid].group.embedding = vec
        sampled = self.scheduler.update_from_output(sched, result)
        outputs = failed + self._outputs_of(self.output.process(sampled))
        if self.scheduler.ended_without_tokens:
            outputs += self._ended_without_tokens()
        if result is not None and result.errors:
            outputs += self._fail_rows(result.errors)
        if self.kv_store is not None and sched.blocks_to_write:
            self.kv_store.after_forward(sched, self.kv.pool)
        counts = sched.num_scheduled_tokens.values()
        context = sched.total_num_scheduled_tokens + sum(
            r.num_computed_tokens for r in (*sched.new_requests, *sched.cached_requests))
        self.last_step = StepStats(
            sched.total_num_scheduled_tokens, len(counts), sum(1 for n in counts if n == 1),
            0 if result is None else len(result.req_ids), t1 - t0, t2 - t1,
            time.perf_counter() - t2, context)  # fmt: skip
        return outputs

    def _idle(self, failed: bool) -> None:
        """Nothing to step: only requests waiting for a grammar or for KV blocks read
        from the store. Wait a little for one rather than spin."""
        if self._compiling and not failed:
            futures.wait([f for _, f in self._compiling.values()], timeout=0.05,
                         return_when=futures.FIRST_COMPLETED)
        elif self.scheduler.store_tier is not None and self.scheduler.waiting_for_kv_load:
            tickets = self.scheduler.store_tier.tickets()
            if tickets:
                tickets[0].wait(0.05)

    def _finish_ended(self) -> None:
        """Finish the requests the output side ended (stop strings, failures): cut a stop
        string's output, then finish through the scheduler (a request it already finished
        takes the output side's reason: the stop string or the error wins)."""
        for ended in self.output.take_ended():
            req = ended.request
            if ended.keep is not None:
                del req.all_token_ids[req.num_prompt_tokens + ended.keep:]
            if req.status.finished:
                req.status = ended.status
            else:
                self.scheduler.finish_request(req, ended.status)
            self.output.count_finished(req)

    def _outputs_of(self, groups: list[RequestGroup]) -> list[RequestOutput]:
        """The outputs of ``groups`` once what processing ended is finished; a group whose
        output cannot be built ends with an error, finished here too."""
        self._finish_ended()
        outputs = self.output.outputs_of(groups)
        self._finish_ended()
        return outputs

    def _ended_without_tokens(self) -> list[RequestOutput]:
        """The outputs of the requests with ``max_tokens=0`` whose prompts were computed."""
        reqs, self.scheduler.ended_without_tokens = self.scheduler.ended_without_tokens, []
        for req in reqs:
            self.output.count_finished(req)
        return self._outputs_of(list({r.group.request_id: r.group for r in reqs}.values()))

    def _fail_rows(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End the requests whose step went wrong (the model side says why) with an error;
        the outputs of their user requests that this changes (a finished group's final
        output, a streamed group's delta)."""
        groups = {}
        for rid, why in errors.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.status.finished:
                continue
            logger.error("request %s failed: %s", req.group.request_id, why)
            self._finish([req], RequestStatus.FINISHED_ERROR)
            groups[req.group.request_id] = req.group
        return self._outputs_of(list(groups.values()))

    def _poll_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the waiting queue; those whose
        constraint failed to compile end with its error (their output carries it)."""
        failed = []
        for rid, (group, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            if group.finished:  # aborted while compiling
                continue
            exc = fut.exception()
            if exc is None:
                for req in group.members:
                    self.scheduler.grammar_ready(req)
                continue
            group.error = exc if isinstance(exc, EngineInputError) else \
                StructuredOutputsError(f"structured_outputs cannot be compiled: {exc}")
            self._finish(group.members, RequestStatus.FINISHED_ERROR)
            failed.append(self.output.make_output(group, force=True))
        return failed

    def check_alive(self) -> None:
        """Raise :class:`~pagedserve.engine.errors.EngineFatalError` when the engine cannot step any
        more (a tensor-parallel rank exited), even while it is idle."""
        self.worker.check_alive()

    def close(self) -> None:
        """Release what outlives the engine object: the tensor-parallel ranks (a no-op
        without them) and the KV block store, which first takes the pool's cached blocks
        (when no request holds any) and writes what it has queued. Unfinished requests
        are left as they are."""
        if self.kv_store is not None:
            try:
                self.reset_prefix_cache()
            except Exception:
                logger.exception("KV store: storing the cache's blocks at shutdown failed")
            self.kv_store.close()
        self.worker.shutdown()

    # -- introspection --------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.kv.stats()
        drafts = self.scheduler.spec_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=s.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            spec_num_drafts=drafts.num_drafts,
            spec_num_draft_tokens=drafts.num_draft_tokens,
            spec_num_accepted_tokens=drafts.num_accepted_tokens,
            loras=lora_names(self.scheduler),
            kv_store=self._recent_kv_store_stats(),
        )

    def _recent_kv_store_stats(self) -> dict[str, int]:
        """:meth:`kv_store_stats`, read again when the scheduler's side of the store has
        moved or after :data:`KV_STORE_STATS_S` seconds."""
        tier = self.scheduler.store_tier
        if tier is None:
            return {}
        now, (then, seen, stats) = time.monotonic(), self._kv_store_seen
        mark = tier.stats.mark()
        if mark != seen or now - then >= KV_STORE_STATS_S:
            stats = self.kv_store_stats()
            self._kv_store_seen = (now, mark, stats)
        return stats

    def kv_store_stats(self) -> dict[str, int]:
        """The KV block store's counters (see :attr:`EngineStats.kv_store`)."""
        tier = self.scheduler.store_tier
        if self.kv_store is None or tier is None:
            return {}
        return {**{f"tier_{k}": v for k, v in tier.counters().items()}, **self.kv_store.stats()}

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached blocks (refused while a request holds blocks); with a
        KV block store, they are written to it first."""
        ok = self.kv.reset_prefix_cache()
        if self.kv_store is not None:
            self.kv_store.put(self.scheduler.take_kv_saves(), wait=True)
        return ok
