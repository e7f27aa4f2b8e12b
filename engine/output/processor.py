"""From sampled tokens to what callers see: detokenization, stop strings, logprobs and
``RequestOutput`` building, apart from the scheduling loop.

Per request it keeps the incremental detokenizer and the stop-string checker (on the
:class:`Request`), per user request what was already streamed. It never calls the
scheduler nor changes a request's tokens or status: a request that a stop string ends (or
whose output cannot be built) is returned by :meth:`OutputProcessor.take_ended`, and the
engine loop finishes it, in the same step that produced it, before its output is built.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.core.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedserve.engine.core.request import Request, RequestGroup, RequestStatus
from pagedserve.engine.core.scheduler_output import SampledToken
from pagedserve.engine.output.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("pagedserve.engine")

OUTPUT_FINAL = "final"
OUTPUT_DELTA = "delta"


@dataclass(slots=True)
class Ended:
    """A request the output side ended: the engine loop finishes it with ``status``, its
    output cut to its first ``keep`` tokens (None: all of them; a stop string's cut drops
    the tokens the step produced after it)."""

    request: Request
    status: RequestStatus
    keep: int | None = None


class OutputProcessor:
    def __init__(self, token_text: Callable[[int], str], tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        """Decodes prompts whose logprobs were asked for (their tokens' offsets)."""
        self.token_text = token_text
        """One token's text decoded alone (cached); logprobs show it."""
        self.groups: dict[str, RequestGroup] = {}
        self._kind: dict[str, str] = {}
        self._sent: dict[str, list[tuple[int, int, int]]] = {}
        """Per user request and choice: (characters, tokens, logprobs) already streamed."""
        self.num_generation_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {}
        self._members: dict[str, Request] = {}
        """Every member request of the user requests added and not yet output finished."""
        self._ended: dict[str, Ended] = {}
        """Requests ended since the engine loop last took them, by request id."""

    def add(self, group: RequestGroup, output_kind: str) -> None:
        rid = group.request_id
        self.groups[rid] = group
        self._kind[rid] = output_kind
        self._sent[rid] = [(0, 0, 0)] * len(group.members)
        for req in group.members:
            self._members[req.request_id] = req

    def take_ended(self) -> list[Ended]:
        """The requests that processing ended since the last call (a stop string, a
        failure), in order, for the engine loop to finish."""
        ended, self._ended = list(self._ended.values()), {}
        return ended

    def _end(self, req: Request, status: RequestStatus, keep: int | None = None) -> None:
        ended = self._ended.get(req.request_id)
        if ended is None:
            self._ended[req.request_id] = Ended(req, status, keep)
        else:  # a failure after a stop string in the same step: the failure wins
            ended.status = status
            ended.keep = keep if keep is not None else ended.keep

    def _num_output(self, req: Request) -> int:
        """The request's output tokens, less those a stop string of this step cut."""
        ended = self._ended.get(req.request_id)
        return req.num_output_tokens if ended is None or ended.keep is None else ended.keep

    def _is_finished(self, req: Request) -> bool:
        return req.status.finished or req.request_id in self._ended

    def _forget(self, group: RequestGroup) -> None:
        rid = group.request_id
        for d in (self.groups, self._kind, self._sent):
            d.pop(rid, None)
        for req in group.members:
            self._members.pop(req.request_id, None)

    def process(self, sampled: Iterable[SampledToken]) -> list[RequestGroup]:
        """Text, stop strings and logprobs of each sampled token; the user requests that
        progressed (:meth:`outputs_of` builds their outputs once the engine loop has
        finished what :meth:`take_ended` returns).

        A failure while processing one request (detokenizing, stop checking) ends that
        request alone with ``finish_reason="error"``; the others of the step are
        unaffected."""
        touched: dict[str, RequestGroup] = {}
        failed: set[int] = set()
        now = time.monotonic()
        for s in sampled:
            touched[s.req.group.request_id] = s.req.group
            if id(s.req) in failed:
                continue
            try:
                self._process_token(s, now)
            except Exception:
                logger.exception("processing the output of %s failed; failing it",
                                 s.req.group.request_id)
                failed.add(id(s.req))
                self._end(s.req, RequestStatus.FINISHED_ERROR)
        return list(touched.values())

    def add_prompt_logprobs(self, entries: dict[str, list[TokenLogprobs]],
                            ) -> list[RequestOutput]:  # fmt: skip
        """A step's prompt logprobs, to their user requests; once a prompt's are all in,
        each entry's text and where it begins in the prompt's text (the prompt's tokens
        decoded, special tokens kept). A request whose entries cannot be described ends
        with an error: its final output is returned."""
        failed = []
        for rid, lps in entries.items():
            req = self._members.get(rid)
            if req is None or req.group.prompt_logprobs is None:
                continue
            group = req.group
            group.prompt_logprobs += lps
            if not group.prompt_logprobs_pending:
                try:
                    self._describe_prompt_logprobs(group)
                except Exception:
                    logger.exception("describing the prompt logprobs of %s failed; failing "
                                     "it", group.request_id)  # fmt: skip
                    failed.append(self._error_output(group))
        return failed

    def _describe_prompt_logprobs(self, group: RequestGroup) -> None:
        ids = group.prompt_token_ids
        detok = IncrementalDetokenizer(self.tokenizer, [], skip_special_tokens=False)
        offset = len(detok.decode_next(ids[0]))
        for token, lp in zip(ids[1:], group.prompt_logprobs, strict=True):
            self._describe(lp, offset)
            offset += len(detok.decode_next(token))

    def _describe(self, lp: TokenLogprobs, text_offset: int) -> None:
        """Fill in the text of an entry and its candidates, and where it begins."""
        lp.decoded = self.token_text(lp.token_id)
        lp.text_offset = text_offset
        for cand in lp.top:
            cand.decoded = self.token_text(cand.token_id)

    def outputs_of(self, groups: Iterable[RequestGroup]) -> list[RequestOutput]:
        """The outputs of ``groups`` that changed; a group whose output cannot be built
        ends with an error (that is its output; :meth:`take_ended` returns its requests)."""
        outs = []
        for g in groups:
            try:
                o = self.make_output(g)
            except Exception:
                logger.exception("building the output of %s failed; failing it",
                                 g.request_id)
                o = self._error_output(g)
            if o is not None:
                outs.append(o)
        return outs

    def _error_output(self, group: RequestGroup) -> RequestOutput:
        """The final output of a user request whose output could not be built: every
        member ends with an error, nothing else is reported."""
        for req in group.members:
            if req.status is not RequestStatus.FINISHED_ERROR:
                self._end(req, RequestStatus.FINISHED_ERROR)
        rid = group.request_id
        self._forget(group)
        return RequestOutput(
            request_id=rid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=[CompletionOutput(index=r.index, text="", token_ids=[],
                                      cumulative_logprob=None, logprobs=None,
                                      finish_reason="error", stop_reason=None)
                     for r in group.members],
            finished=True, metrics=group.members[0].metrics, num_cached_tokens=0)

    def _process_token(self, s: SampledToken, now: float) -> None:
        req, token = s.req, s.token_id
        if s.num_output > self._num_output(req):
            return  # after a stop string that an earlier token of this step completed
        self.num_generation_tokens_total += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        match = s.num_output >= req.params.min_tokens
        start = req.text_fed
        if not s.stopped_by_token:
            # Stop strings end the output only once min_tokens are out (one may begin
            # before that).
            self._feed(req, req.detok.decode_next(token), match, s.num_output)
        if s.logprobs is not None:
            lp = s.logprobs
            self._describe(lp, start)
            req.logprobs.append(lp)
            req.logprob_text_ends.append(req.text_fed)
            req.cumulative_logprob += lp.logprob
        if self._is_finished(req) and s.num_output == self._num_output(req):
            self._finish_text(req, token, s.stopped_by_token, match)
        if req.request_id not in self._ended:  # else counted once the loop finishes it
            self.count_finished(req)

    def _feed(self, req: Request, text: str, match: bool, num_output: int) -> None:
        req.text_fed += len(text)
        emitted, matched = req.stop_checker.feed(text, match=match)
        req.output_text += emitted
        if matched is not None:
            req.stop_reason = matched
            # The stop string ends the request (also one the scheduler just ended by
            # length: the stop string, completed by the same token, wins); tokens the
            # step produced after this one (accepted drafts) are not output.
            self._end(req, RequestStatus.FINISHED_STOPPED, keep=num_output)

    def _finish_text(self, req: Request, token: int, by_token: bool, match: bool) -> None:
        """The end of a finished request's text: what the detokenizer and the stop checker
        still hold."""
        if isinstance(req.stop_reason, str):
            return
        if by_token and req.params.include_stop_str_in_output:
            # The stop token's own text (empty for a special token skipped in the
            # output), after whatever the stop checker holds.
            req.output_text += (req.stop_checker.flush() + req.detok.decode_next(token)
                                + req.detok.flush())
            return
        # Text held back for a character the output ends inside of (U+FFFD, as a full
        # decode gives), still checked for stop strings.
        tail = req.detok.flush()
        if tail:
            self._feed(req, tail, match, self._num_output(req))
        if not isinstance(req.stop_reason, str):
            req.output_text += req.stop_checker.flush()

    def count_finished(self, req: Request) -> None:
        """Record a finished request once (time and reason)."""
        if req.status.finished and req.metrics.finished_time is None:
            req.metrics.finished_time = time.monotonic()
            reason = req.finish_reason or "error"
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    @staticmethod
    def _prompt_logprobs_of(group: RequestGroup, kind: str) -> list | None:
        """``[None, entry, ...]`` (the first prompt token has none) once every entry is
        in; a stream carries them once."""
        lps = group.prompt_logprobs
        if lps is None or group.prompt_logprobs_pending:
            return None
        if kind == OUTPUT_DELTA:
            if group.prompt_logprobs_sent:
                return None
            group.prompt_logprobs_sent = True
        return [None, *lps]

    def make_output(self, group: RequestGroup, force: bool = False) -> RequestOutput | None:
        rid = group.request_id
        kind = self._kind.get(rid, OUTPUT_FINAL)
        finished = group.finished
        if kind == OUTPUT_FINAL and not finished and not force:
            return None
        sent = self._sent.get(rid)
        outs = []
        for req in group.members:
            text, lps = req.output_text, req.logprobs
            # Logprobs go out with their tokens' text: not while the stop checker holds
            # it back, never for a stop string's tokens.
            n_lps = 0 if lps is None else bisect.bisect_right(req.logprob_text_ends, len(text))
            t0 = i0 = l0 = 0
            if kind == OUTPUT_DELTA and sent is not None:
                # Slice only what is new: a stream costs O(new tokens) per step, not O(all).
                t0, i0, l0 = sent[req.index]
                sent[req.index] = (len(text), req.num_output_tokens, n_lps)
                text = text[t0:]
            if lps is not None:
                lps = lps[l0:n_lps]
            outs.append(CompletionOutput(
                index=req.index, text=text,
                token_ids=req.all_token_ids[req.num_prompt_tokens + i0:],
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=lps, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            ))  # fmt: skip
        first = group.members[0]
        out = RequestOutput(
            request_id=rid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=outs, finished=finished, metrics=first.metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0), error=group.error,
            prompt_logprobs=self._prompt_logprobs_of(group, kind), embedding=group.embedding,
        )  # fmt: skip
        if finished:
            self._forget(group)
        return out
