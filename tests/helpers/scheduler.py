"""A fake model side for scheduler tests: it keeps its own view of each request from
the step descriptions alone, and "samples" a fixed token per request."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from pagedserve.engine.core.request import Request, RequestGroup, RequestStatus
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

BS = 4
EOS = 2


@dataclass
class FakeState:
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class FakeRunner:
    """The model side: keeps its own copy of each request from the diffs alone and
    "samples" a fixed token per request (``next_token``)."""

    next_token: dict[str, int] = field(default_factory=dict)
    requests: dict[str, FakeState] = field(default_factory=dict)
    seen_finished: list[str] = field(default_factory=list)
    propose: dict[str, list[int]] = field(default_factory=dict)
    """Speculation: the drafts a request proposes after each of its steps."""
    accept: dict[str, int] = field(default_factory=dict)
    """Speculation: how many of its drafts a request keeps (default: all)."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        # What crosses the boundary is plain data: it survives a pickle round trip.
        sched = pickle.loads(pickle.dumps(sched))
        for rid in sched.finished_req_ids:
            self.seen_finished.append(rid)
            del self.requests[rid]
        for rid in sched.preempted_req_ids:
            self.requests[rid].blocks = []
        for new in sched.new_requests:
            assert new.req_id not in self.requests
            self.requests[new.req_id] = FakeState(
                [*new.prompt_token_ids, *new.output_token_ids], list(new.block_ids),
                new.num_computed_tokens)  # fmt: skip
        for c in sched.cached_requests:
            st = self.requests[c.req_id]
            st.tokens += c.new_token_ids
            st.blocks += c.new_block_ids
            st.computed = c.num_computed_tokens
        ids, toks = [], []
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.requests[rid]
            drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
            assert st.computed + n <= len(st.tokens) + len(drafts)
            assert len(st.blocks) * BS >= st.computed + n  # the table covers the step
            if st.computed + n == len(st.tokens) + len(drafts):
                ids.append(rid)
                kept = drafts[:self.accept.get(rid, len(drafts))]
                toks.append([*kept, self.next_token.get(rid, 7)])
        if not ids:
            return None
        spec = {rid: self.propose[rid] for rid in ids if rid in self.propose}
        return ModelRunnerOutput(ids, toks, [None] * len(ids), spec)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    group = RequestGroup(rid, None, list(prompt), sp, 0.0)
    req = Request(rid, group, 0, sp, group.prompt_token_ids, max_tokens, eos_token_ids=(EOS,))
    group.members.append(req)
    return req


def make_scheduler(num_blocks=16, max_num_seqs=8, budget=16, prefix=True, **kw) -> Scheduler:
    return Scheduler(num_blocks, BS, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=256, enable_prefix_caching=prefix, **kw)  # fmt: skip


def run_step(s: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = s.schedule()
    if not out.is_empty:
        s.update_from_output(out, runner.execute(out))
        for rid, st in runner.requests.items():  # the runner's view equals the scheduler's
            req = s.requests.get(rid)
            if req is not None and req.status is RequestStatus.RUNNING:
                assert st.tokens == req.all_token_ids[: len(st.tokens)]
                assert st.blocks == s.kv.get_block_table(rid)
    s.kv.check_invariants()
    return out
