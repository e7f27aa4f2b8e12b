"""Randomized state-machine tests of the block manager.

Requests share random prefixes (and sometimes a salt) over a tiny vocabulary so that hits,
duplicates and evictions are frequent; each step is one of admit (lookup + allocate,
possibly chunked), decode/prefill, fork, finish, preempt, churn (fill and free) and
reset. After every step the manager's own invariants are checked, plus what only the test
knows: every cached block in a table holds exactly that request's tokens, and every
position a request's next token reads holds a real block in every KV group (sliding
groups give back only what their windows have left).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedserve.blockmgr import KVCacheManager
from pagedserve.blockmgr.groups import KVGroups
from tests.helpers.blockmgr import BS, FakeRequest

GROUPS = [
    None,  # one full-attention group
    KVGroups((None, 5, 5, 9), ((3,), (0,), (1,), (2,))),  # Gemma-like: full, then sliding
    KVGroups((6,), ((0, 1),)),  # every layer slides (Mistral v0.1)
]
"""Group layouts the machine runs (windows in tokens, blocks of ``BS`` = 4)."""
PREFIXES = [[], list(range(100, 112)), list(range(100, 106)) + [7] * 6, [1, 2, 3, 4, 5, 6, 7, 8]]
SALTS = [None, None, "s"]


class Model:
    """Drives a manager the way the scheduler does and checks it against the requests."""

    def __init__(self, num_blocks: int, caching: bool, groups: KVGroups | None = None) -> None:
        self.mgr = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, groups=groups)
        self.waiting: dict[str, FakeRequest] = {}
        self.running: dict[str, FakeRequest] = {}
        self.next_id = 0

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def add(self, tokens: list[int], salt: str | None) -> FakeRequest:
        req = FakeRequest(self.new_id(), tokens, cache_salt=salt)
        self.waiting[req.request_id] = req
        return req

    def check_hit(self, req: FakeRequest, blocks: list[int], n: int) -> None:
        mgr = self.mgr
        assert n == len(blocks) * BS
        assert len(blocks) <= (len(req.all_token_ids) - 1) // BS
        for i, b in enumerate(blocks):
            if b == mgr.null_block:  # below group 0's window
                continue
            parent, tokens, extras = mgr.pool.block_meta[b]
            assert tokens == req.all_token_ids[i * BS:(i + 1) * BS]
            if i == 0:
                assert extras == (() if req.cache_salt is None else (req.cache_salt,))

    def admit(self, req: FakeRequest, budget: int) -> bool:
        mgr = self.mgr
        blocks, n = mgr.get_computed_blocks(req)
        self.check_hit(req, blocks, n)
        num_new = min(len(req.all_token_ids) - n, budget)
        if not mgr.allocate_slots(req, num_new, blocks or None):
            return False
        self.check_reads(req, n)
        req.num_computed_tokens = n + num_new
        del self.waiting[req.request_id]
        self.running[req.request_id] = req
        return True

    def advance(self, req: FakeRequest, token: int, budget: int) -> bool:
        """One scheduler step for a running request; preempts it if blocks run out."""
        remaining = len(req.all_token_ids) - req.num_computed_tokens
        if remaining == 0:
            req.all_token_ids.append(token)
            remaining = 1
        num_new = min(remaining, budget)
        if self.mgr.allocate_slots(req, num_new):
            req.num_computed_tokens += num_new
            return True
        self.preempt(req)
        return False

    def preempt(self, req: FakeRequest) -> None:
        self.mgr.free(req)
        req.num_computed_tokens = 0
        del self.running[req.request_id]
        self.waiting[req.request_id] = req

    def finish(self, req: FakeRequest) -> None:
        self.mgr.free(req)
        self.running.pop(req.request_id, None)
        self.waiting.pop(req.request_id, None)

    def fork(self, parent: FakeRequest) -> None:
        child = FakeRequest(self.new_id(), list(parent.all_token_ids), cache_salt=parent.cache_salt)
        limit = min(parent.num_computed_tokens, len(child.all_token_ids) - 1)
        shared = self.mgr.fork(parent, child, limit)
        assert shared % BS == 0 and shared <= max(limit, 0)
        for c, p in zip(self.mgr.get_block_tables(child.request_id),
                        self.mgr.get_block_tables(parent.request_id), strict=True):
            assert c == (p[:shared // BS] if shared else [])
        if shared:
            self.check_reads(child, shared)
        child.num_computed_tokens = shared
        self.running[child.request_id] = child
        if not self.mgr.allocate_slots(child, len(child.all_token_ids) - shared):
            self.preempt(child)
        else:
            child.num_computed_tokens = len(child.all_token_ids)

    def churn(self, rng: random.Random, num_tokens: int) -> None:
        """A throwaway request with fresh tokens: evicts cached free blocks."""
        req = FakeRequest(self.new_id(), [rng.randrange(1000, 2000) for _ in range(num_tokens)])
        if self.mgr.allocate_slots(req, num_tokens):
            self.mgr.free(req)

    def check_reads(self, req: FakeRequest, num_computed: int) -> None:
        """Every group holds a real block wherever the query at token ``num_computed``
        (and every later one) reads."""
        mgr = self.mgr
        for w, table in zip(mgr.windows, mgr.get_block_tables(req.request_id), strict=True):
            first = 0 if w is None else max(0, num_computed - w + 1) // BS
            assert mgr.null_block not in table[first:], (
                f"{req.request_id}: window {w} from token {num_computed} reads {table}")

    def check(self) -> None:
        mgr = self.mgr
        mgr.check_invariants()
        held: set[int] = set()
        for rid, req in self.running.items():
            tables = mgr.get_block_tables(rid)
            assert len(tables[0]) >= -(-req.num_computed_tokens // BS)
            self.check_reads(req, req.num_computed_tokens)
            for table in tables:
                real = [b for b in table if b != mgr.null_block]
                held.update(real)
                for i, b in enumerate(table):
                    meta = None if b == mgr.null_block else mgr.pool.block_meta[b]
                    if meta is not None and (i + 1) * BS <= len(req.all_token_ids):
                        assert meta[1] == req.all_token_ids[i * BS:(i + 1) * BS], (
                            f"{rid}: cached block {b} at {i} holds other tokens")
        for rid in self.waiting:
            assert mgr.num_allocated_blocks(rid) == 0
        assert mgr.num_free_blocks == mgr.num_blocks - len(held)

    def drain(self) -> None:
        for req in list(self.running.values()) + list(self.waiting.values()):
            self.finish(req)
            self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks
        assert self.mgr.usage == 0.0
        assert self.mgr.stats().num_slots_allocated == 0


class BlockManagerMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    @initialize(num_blocks=st.integers(6, 40), caching=st.booleans(),
                groups=st.sampled_from(GROUPS))
    def setup(self, num_blocks: int, caching: bool, groups: KVGroups | None) -> None:
        self.model = Model(num_blocks * (1 if groups is None else groups.num_groups), caching,
                           groups)

    @rule(target=reqs, prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 5), min_size=1, max_size=10), salt=st.sampled_from(SALTS))
    def new_request(self, prefix: list[int], suffix: list[int], salt: str | None) -> str:
        return self.model.add(prefix + suffix, salt).request_id

    @rule(rid=reqs, budget=st.integers(1, 32))
    def admit(self, rid: str, budget: int) -> None:
        req = self.model.waiting.get(rid)
        if req is not None:
            self.model.admit(req, budget)

    @rule(rid=reqs, token=st.integers(0, 5), budget=st.integers(1, 8))
    def advance(self, rid: str, token: int, budget: int) -> None:
        req = self.model.running.get(rid)
        if req is not None:
            self.model.advance(req, token, budget)

    @rule(target=reqs, rid=reqs)
    def fork(self, rid: str) -> str:
        req = self.model.running.get(rid)
        if req is None:
            return rid
        self.model.fork(req)
        return f"r{self.model.next_id}"

    @rule(rid=consumes(reqs))
    def finish(self, rid: str) -> None:
        for pool in (self.model.running, self.model.waiting):
            if rid in pool:
                self.model.finish(pool[rid])

    @rule(rid=reqs)
    def preempt(self, rid: str) -> None:
        req = self.model.running.get(rid)
        if req is not None:
            self.model.preempt(req)

    @rule(seed=st.integers(0, 2**16), num_tokens=st.integers(1, 40))
    def churn(self, seed: int, num_tokens: int) -> None:
        self.model.churn(random.Random(seed), num_tokens)

    @precondition(lambda self: hasattr(self, "model"))
    @rule()
    def reset(self) -> None:
        ok = self.model.mgr.reset_prefix_cache()
        assert ok == (self.model.mgr.num_free_blocks == self.model.mgr.num_blocks)
        if ok:
            assert not self.model.mgr.pool.cached

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "model"):
            self.model.check()

    def teardown(self) -> None:
        if hasattr(self, "model"):
            self.model.drain()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("groups", GROUPS, ids=["full", "gemma", "all_sliding"])
def test_random_soak(groups: KVGroups | None) -> None:
    """A long seeded run with many concurrent requests (plain random, no shrinking)."""
    rng = random.Random(1234)
    for caching in (True, False):
        model = Model(48 * (1 if groups is None else groups.num_groups), caching, groups)
        for _ in range(3000):
            op = rng.random()
            if op < 0.2:
                model.add(rng.choice(PREFIXES) + [rng.randrange(6) for _ in range(rng.randrange(1, 12))],
                          rng.choice(SALTS))
            elif op < 0.4 and model.waiting:
                model.admit(rng.choice(list(model.waiting.values())), rng.randrange(1, 32))
            elif op < 0.75 and model.running:
                model.advance(rng.choice(list(model.running.values())), rng.randrange(6),
                              rng.randrange(1, 8))
            elif op < 0.8 and model.running:
                model.fork(rng.choice(list(model.running.values())))
            elif op < 0.88 and (model.running or model.waiting):
                model.finish(rng.choice(list(model.running.values()) + list(model.waiting.values())))
            elif op < 0.93 and model.running:
                model.preempt(rng.choice(list(model.running.values())))
            elif op < 0.99:
                model.churn(rng, rng.randrange(1, 60))
            else:
                model.mgr.reset_prefix_cache()
            model.check()
        stats = model.mgr.stats()
        if caching:
            assert stats.prefix_cache_hits > 0
            assert model.mgr.pool.num_evictions > 0
        model.drain()
