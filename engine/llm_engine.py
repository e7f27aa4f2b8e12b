"""``LLMEngine``: the engine core shared by the offline ``LLM`` and the server.

``add_request`` validates and queues; ``step`` runs one scheduler + model step and
returns the outputs of the requests that progressed. The engine is single-threaded:
the server drives it from its own engine thread, the offline API from the caller's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestGroup, RequestStatus
from engine.sampler import check_token_ids, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.stop import StopChecker
from engine.worker import Worker

logger = logging.getLogger("engine")

OUTPUT_FINAL = "final"
OUTPUT_DELTA = "delta"


class PromptTooLongError(ValueError):
    """Prompt plus requested tokens do not fit the context (or the whole KV cache)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        w = self.worker
        self.tokenizer = w.tokenizer
        self.token_text = functools.lru_cache(maxsize=65536)(self._decode_token)
        """One token's text decoded alone (cached); logprobs show it."""
        self.max_model_len = w.max_model_len
        self.kv = w.kv_manager
        self.block_size = config.block_size
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=w.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.eos_token_ids = w.eos_token_ids
        self.vocab_size = w.vocab_size
        self._groups: dict[str, RequestGroup] = {}
        self._output_kind: dict[str, str] = {}
        self._sent: dict[str, list[tuple[int, int]]] = {}
        self._counter = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {}

    # -- requests -----------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._counter)}"

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_length(self, num_prompt_tokens: int, params: SamplingParams, param: str) -> int:
        """Validate lengths; return the effective max_tokens. Raises PromptTooLongError."""
        if num_prompt_tokens == 0:
            raise PromptTooLongError("the prompt is empty: at least one token is required", param)
        room = self.max_model_len - num_prompt_tokens
        capacity = self.kv.num_blocks * self.block_size  # tokens the whole cache holds
        if params.max_tokens is None:
            if room < 1:
                raise PromptTooLongError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your prompt has {num_prompt_tokens} tokens, which leaves no room "
                    f"for a completion.", param)
            # Up to the end of the context, or of what the whole KV cache (and, with
            # chunked prefill off, one step) can hold.
            limit = capacity
            if not self.config.enable_chunked_prefill:
                limit = min(limit, self.scheduler.max_num_batched_tokens)
            max_tokens = min(room, limit - num_prompt_tokens)
            if max_tokens < 1:
                raise PromptTooLongError(
                    f"the prompt has {num_prompt_tokens} tokens, which leaves no room for a "
                    f"completion in the {limit} tokens one request can hold (the KV cache "
                    f"has {self.kv.num_blocks} blocks of {self.block_size} tokens)", param)
        else:
            max_tokens = params.max_tokens
            if num_prompt_tokens + max_tokens > self.max_model_len:
                raise PromptTooLongError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                    f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
                    f"Please reduce the length of the prompt or the completion.",
                    param if room < 1 else "max_tokens")
        need = -(-(num_prompt_tokens + max_tokens) // self.block_size)
        if need > self.kv.num_blocks:
            raise PromptTooLongError(
                f"the request needs {need} KV cache blocks ({num_prompt_tokens} prompt + "
                f"{max_tokens} completion tokens) but the whole cache has {self.kv.num_blocks} "
                f"blocks of {self.block_size} tokens",
                "max_tokens" if num_prompt_tokens < capacity else param)
        if not self.config.enable_chunked_prefill and \
                num_prompt_tokens + max_tokens > self.scheduler.max_num_batched_tokens:
            raise PromptTooLongError(
                f"with chunked prefill off, prompt + completion ({num_prompt_tokens + max_tokens}) "
                f"must fit max_num_batched_tokens={self.scheduler.max_num_batched_tokens}", param)
        return max_tokens

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        output_kind: str = OUTPUT_FINAL,
        param_name: str = "prompt",
    ) -> RequestGroup:
        request_id = request_id or self.new_request_id()
        if request_id in self._groups:
            raise ValueError(f"request_id={request_id!r} is already in use")
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise PromptTooLongError(
                    f"prompt token id {t!r} is out of range [0, {self.vocab_size})", param_name)
        check_token_ids(params, self.vocab_size)
        max_tokens = self.check_length(len(prompt_token_ids), params, param_name)
        params._eos_token_ids = self.eos_token_ids
        now = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), params, now)
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                group=group,
                index=i,
                params=params,
                prompt_token_ids=group.prompt_token_ids,
                max_tokens=max_tokens,
                cache_salt=cache_salt,
                arrival_time=now,
            )
            req.generator = make_generator(params, self.worker.device, i)
            req.detok = IncrementalDetokenizer(
                self.tokenizer, group.prompt_token_ids, params.skip_special_tokens,
                params.spaces_between_special_tokens)
            req.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
            group.members.append(req)
        self._groups[request_id] = group
        self._output_kind[request_id] = output_kind
        self._sent[request_id] = [(0, 0)] * params.n
        for req in group.members:
            self.scheduler.add_request(req)
        self.num_prompt_tokens_total += len(prompt_token_ids)
        return group

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request wherever it is; its blocks return to the pool at once."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for req in group.members:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return self._make_output(group, force=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        for req, _ in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        try:
            reqs, out = self.worker.execute(sched)
        except Exception:
            logger.exception("model step failed; failing the %d requests in it",
                             len(sched.scheduled))
            failed = {r.group.request_id: r.group for r, _ in sched.scheduled}
            for req, _ in sched.scheduled:
                self._finish(req, RequestStatus.FINISHED_ERROR)
            # Blocks of this step were registered in the prefix cache but never written.
            self.kv.drop_unreferenced_cache()
            return [self._make_output(g, force=True) for g in failed.values()]
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        if out is not None:
            for i, req in enumerate(reqs):
                self._append_token(req, out.token_ids[i], out.logprobs[i], now)
                touched[req.group.request_id] = req.group
        return [o for g in touched.values() if (o := self._make_output(g)) is not None]

    def _append_token(self, req: Request, token: int, logprob: Any, now: float) -> None:
        req.all_token_ids.append(token)
        self.num_generation_tokens_total += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if logprob is not None:
            logprob.decoded = self.token_text(logprob.token_id)
            for cand in logprob.top:
                cand.decoded = self.token_text(cand.token_id)
            req.logprobs.append(logprob)
            req.cumulative_logprob += logprob.logprob
        p = req.params
        n_out = req.num_output_tokens
        status = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
        by_token = status is not None  # EOS or a stop token: its text is not decoded
        if status is None:
            delta = req.detok.decode_next(token)
            # Stop strings end the output only once min_tokens are out (one may begin
            # before that).
            emitted, matched = req.stop_checker.feed(delta, match=n_out >= p.min_tokens)
            req.output_text += emitted
            if matched is not None:
                req.stop_reason = matched
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if not isinstance(req.stop_reason, str):  # EOS, stop token or length
                if by_token and p.include_stop_str_in_output:
                    # The stop token's own text (empty for a special token skipped in
                    # the output), after whatever the stop checker holds.
                    req.output_text += (req.stop_checker.flush() + req.detok.decode_next(token)
                                        + req.detok.flush())
                else:
                    # Text held back for a character the output ends inside of (U+FFFD,
                    # as a full decode gives), still checked for stop strings.
                    tail = req.detok.flush()
                    if tail:
                        emitted, matched = req.stop_checker.feed(
                            tail, match=n_out >= p.min_tokens)
                        req.output_text += emitted
                        if matched is not None:
                            req.stop_reason = matched
                            status = RequestStatus.FINISHED_STOPPED
                    if not isinstance(req.stop_reason, str):
                        req.output_text += req.stop_checker.flush()
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status.finished:
            return
        self.scheduler.finish(req, status)
        req.metrics.finished_time = time.monotonic()
        reason = req.finish_reason or "error"
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def _make_output(self, group: RequestGroup, force: bool = False) -> RequestOutput | None:
        rid = group.request_id
        kind = self._output_kind.get(rid, OUTPUT_FINAL)
        finished = group.finished
        if kind == OUTPUT_FINAL and not finished and not force:
            return None
        sent = self._sent.get(rid)
        outs = []
        for req in group.members:
            text, lps = req.output_text, req.logprobs
            t0 = i0 = 0
            if kind == OUTPUT_DELTA and sent is not None:
                # Slice only what is new: a stream costs O(new tokens) per step, not O(all).
                t0, i0 = sent[req.index]
                sent[req.index] = (len(text), req.num_output_tokens)
                text = text[t0:]
                lps = lps[i0:] if lps is not None else None
            ids = req.all_token_ids[req.num_prompt_tokens + i0:]
            outs.append(CompletionOutput(
                index=req.index,
                text=text,
                token_ids=ids,
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=lps,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
            ))
        first = group.members[0]
        out = RequestOutput(
            request_id=rid,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=first.metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )
        if finished:
            self._groups.pop(rid, None)
            self._output_kind.pop(rid, None)
            self._sent.pop(rid, None)
        return out

    # -- introspection --------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.kv.stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=s.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
