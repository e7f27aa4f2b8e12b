"""The thread side of the server: one engine thread drives ``LLMEngine`` for an event loop.

The event loop posts commands (add, abort) to a lock-free step queue (a
``collections.deque``; ``append`` and ``popleft`` are atomic) and sets a wake-up event.
The engine thread drains the queue, runs ``LLMEngine.step()``, and hands each step's
outputs back to the loop in ONE ``loop.call_soon_threadsafe`` call, where they are put
on the per-request ``asyncio.Queue`` of each request. The loop never waits on a step.

A failed forward pass fails the requests of that step (``LLMEngine.step``); the thread
then steps a one-token request, with what was already admitted, before it drains new
commands. If the engine thread dies (that check failing, or an exception outside the
per-request handling of ``LLMEngine.step``), every registered request receives an
:class:`EngineDeadError`, :attr:`AsyncEngine.is_alive` turns false and
:attr:`AsyncEngine.on_death` is called.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.kv_state import DEFAULT_MAX_CELLS, KVState, KVStateTaker
from pagedserve.engine.core.outputs import RequestOutput
from pagedserve.engine.core.pooling import PoolingParams
from pagedserve.engine.core.sampling_params import SamplingParams
from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.loop.engine_info import EngineInfo
from pagedserve.engine.loop.llm_engine import OUTPUT_DELTA, LLMEngine
from pagedserve.engine.lora.request import LoRARequest

logger = logging.getLogger("pagedserve.engine.async")

_IDLE_WAIT_S = 1.0
"""How long the idle engine thread sleeps between heartbeats when nothing wakes it."""

STALL_TIMEOUT_S = 120.0
"""An engine thread that has not finished a step (or an idle heartbeat) for this long is
reported unhealthy: a step that hangs turns ``/health`` to 503."""


@dataclass(slots=True)
class EngineSnapshot:
    """Engine counters taken on the engine thread after a step (read on the loop)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    adds_drained: int = 0
    """Sequences (``n`` per add command) the engine thread had drained when the snapshot
    was taken."""
    max_loras: int = 0
    """LoRA adapters a step may hold (0: LoRA is off)."""
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    """Names of the adapters of running and waiting requests."""
    kv_store: dict[str, int] = field(default_factory=dict)
    """The KV block store's counters (:attr:`pagedserve.engine.loop.llm_engine.EngineStats.kv_store`)."""
    time: float = 0.0


@dataclass(slots=True)
class StepItem:
    """What a request's queue receives for one step: its output and the step's end time."""

    output: RequestOutput
    step_time: float


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    lora_request: LoRARequest | None = None
    pooling: PoolingParams | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class _KVStateAsk:
    max_cells: int
    tables: bool
    future: asyncio.Future


class AsyncEngine:
    """Runs an :class:`LLMEngine` on its own thread and feeds asyncio queues.

    All public methods except :meth:`start` and :meth:`shutdown` must be called from
    the event loop's thread.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: deque[Any] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._dead: BaseException | None = None
        self._adds_posted = 0
        self._adds_drained = 0  # engine thread only
        self._kv_state = KVStateTaker()  # engine thread only
        self.snapshot = EngineSnapshot()
        self.on_snapshot: Callable[[EngineSnapshot], None] | None = None
        """Called on the loop with each new snapshot (metrics hook)."""
        self.on_death: Callable[[BaseException], None] | None = None
        """Called on the loop once the engine thread has died (after its requests failed)."""
        self.last_progress = time.monotonic()
        self.stall_timeout = STALL_TIMEOUT_S

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model and build the engine (slow: call it off the event loop)."""
        return cls(LLMEngine(config))

    @property
    def info(self) -> EngineInfo:
        """Names, limits and the tokenizer: all a front end reads of the engine."""
        return self.engine.info

    # -- lifecycle (any thread) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are handed back to ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step (unfinished requests are left),
        then close the engine (its tensor-parallel ranks stop)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and has not failed."""
        return (self._dead is None and self._thread is not None
                and self._thread.is_alive())

    @property
    def is_healthy(self) -> bool:
        """Alive and progressing: the last step or idle heartbeat is recent."""
        return self.is_alive and time.monotonic() - self.last_progress < self.stall_timeout

    @property
    def error(self) -> BaseException | None:
        return self._dead

    # -- loop side ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Post a request; its :class:`StepItem`s (delta outputs) arrive on ``queue``.

        Several requests may share one queue (one HTTP request with several prompts).
        Validation errors raised on the engine thread arrive on the queue as exceptions.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        self._queues[request_id] = queue
        self._adds_posted += params.n
        self._commands.append(_Add(request_id, prompt_token_ids, params, prompt,
                                   arrival_time if arrival_time is not None else time.monotonic(),
                                   lora_request, pooling, cache_salt))  # fmt: skip
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; nothing more is delivered for it."""
        if self._queues.pop(request_id, None) is None:
            return
        self._commands.append(("abort", request_id))
        self._wake.set()

    def retire_lora(self, lora_int_id: int) -> None:
        """Free an unloaded adapter's weights (once no live request uses them)."""
        self._commands.append(("retire_lora", lora_int_id))

    def kv_state(self, max_cells: int = DEFAULT_MAX_CELLS,
                 tables: bool = True) -> asyncio.Future[KVState]:
        """A future of the KV cache snapshot, taken by the engine thread between steps
        (:meth:`pagedserve.engine.core.kv_state.KVStateTaker.take`); asks made during a step share one snapshot."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        assert self._loop is not None, "the engine thread is not started"
        fut = self._loop.create_future()
        self._commands.append(_KVStateAsk(max_cells, tables, fut))
        self._wake.set()
        return fut

    def fail_all(self, exc: BaseException) -> None:
        """Abort every request and deliver ``exc`` to each of them (used at shutdown)."""
        for rid, q in list(self._queues.items()):
            q.put_nowait(exc)
            self.abort(rid)

    @property
    def num_requests(self) -> int:
        """Requests posted and not yet finished or aborted."""
        return len(self._queues)

    def num_waiting_estimate(self) -> int:
        """Waiting sequences now: the last snapshot's plus those posted since (``n`` per
        request), beyond free slots."""
        snap = self.snapshot
        pending = self._adds_posted - snap.adds_drained
        free = max(0, self.info.max_num_seqs - snap.num_running - snap.num_waiting)
        return snap.num_waiting + max(0, pending - free)

    def _deliver(self, items: list[RequestOutput], step_time: float,
                 snapshot: EngineSnapshot | None) -> None:
        queues = self._queues
        for out in items:
            q = queues.get(out.request_id)
            if q is None:
                continue
            # A request that failed before it ran (a grammar that did not compile).
            q.put_nowait(StepItem(out, step_time) if out.error is None else out.error)
            if out.finished:
                del queues[out.request_id]
        if snapshot is not None:
            self.snapshot = snapshot
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(exc)

    def _on_death(self, exc: BaseException) -> None:
        self._dead = exc
        err = EngineDeadError(f"the engine stopped: {exc!r}")
        for q in self._queues.values():
            q.put_nowait(err)
        self._queues.clear()
        for cmd in self._commands:
            if isinstance(cmd, _KVStateAsk) and not cmd.future.done():
                cmd.future.set_exception(err)
        if self.on_death is not None:
            self.on_death(exc)

    @staticmethod
    def _resolve(asks: list[_KVStateAsk], states: dict[tuple[int, bool], KVState]) -> None:
        for ask in asks:
            if not ask.future.done():
                ask.future.set_result(states[ask.max_cells, ask.tables])

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            while True:
                self._wake.clear()
                changed = self._drain()
                if self._stop:
                    return
                eng = self.engine
                check_alive = getattr(eng, "check_alive", None)
                if check_alive is not None:
                    check_alive()  # a tensor-parallel rank that exited ends the thread
                if getattr(eng, "needs_self_check", False):
                    self._self_check(loop)
                    continue
                if eng.has_unfinished_requests():
                    t0 = time.monotonic()
                    outs = eng.step()
                    now = time.monotonic()
                    self.last_progress = now
                    loop.call_soon_threadsafe(self._deliver, outs, now, self._snap(now))
                    if not outs and now - t0 < 1e-3:
                        self._wake.wait(0.005)  # nothing schedulable: do not spin
                else:
                    if changed:
                        now = time.monotonic()
                        loop.call_soon_threadsafe(self._deliver, [], now, self._snap(now))
                    self.last_progress = time.monotonic()
                    self._wake.wait(_IDLE_WAIT_S)
        except BaseException as exc:  # noqa: BLE001 - the loop must learn about any death
            logger.exception("the engine thread failed; failing all requests")
            try:
                loop.call_soon_threadsafe(self._on_death, exc)
            except RuntimeError:  # loop already closed
                self._dead = exc

    def _self_check(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a failed forward pass, step a one-token request (with what was already
        admitted) before draining new commands; if that fails too, the engine thread
        dies (and the server exits for its supervisor to restart it)."""
        eng = self.engine
        rid = eng.self_check_request()
        logger.warning("a model step failed; checking the engine with a one-token step")
        while True:
            outs = eng.step()
            now = time.monotonic()
            self.last_progress = now
            loop.call_soon_threadsafe(self._deliver, outs, now, self._snap(now))
            mine = next((o for o in outs if o.request_id == rid and o.finished), None)
            if mine is None:
                continue
            if mine.outputs[0].finish_reason == "error":
                raise EngineDeadError("the engine failed its check after a failed step")
            logger.info("engine check passed; serving again")
            return

    def _drain(self) -> bool:
        """Apply queued commands; return whether any was applied."""
        cmds = self._commands
        eng = self.engine
        applied = False
        asks: list[_KVStateAsk] = []
        while cmds:
            cmd = cmds.popleft()
            applied = True
            if isinstance(cmd, _KVStateAsk):
                asks.append(cmd)
            elif isinstance(cmd, _Add):
                self._adds_drained += cmd.params.n
                try:
                    eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    prompt=cmd.prompt, arrival_time=cmd.arrival_time,
                                    output_kind=OUTPUT_DELTA, lora_request=cmd.lora_request,
                                    pooling=cmd.pooling, cache_salt=cmd.cache_salt)
                except Exception as exc:  # a bad request harms no one else
                    self._loop.call_soon_threadsafe(self._deliver_error, cmd.request_id, exc)
            elif cmd[0] == "retire_lora":
                eng.retire_lora(cmd[1])
            else:
                _, rid = cmd
                eng.abort_request(rid)
        if asks:
            self._answer(asks)
        return applied

    def _answer(self, asks: list[_KVStateAsk]) -> None:
        """One snapshot per distinct ask, taken after the drained commands applied."""
        eng = self.engine
        now = time.monotonic()
        totals = {"prompt_tokens_total": eng.num_prompt_tokens_total,
                  "generation_tokens_total": eng.num_generation_tokens_total}
        states = {}
        for key in {(a.max_cells, a.tables) for a in asks}:
            states[key] = self._kv_state.take(eng.scheduler, now, key[0], key[1], totals)
        self._loop.call_soon_threadsafe(self._resolve, asks, states)

    def _snap(self, now: float) -> EngineSnapshot:
        eng = self.engine
        s = eng.stats()
        return EngineSnapshot(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prompt_tokens_total=eng.num_prompt_tokens_total,
            generation_tokens_total=eng.num_generation_tokens_total,
            finished_by_reason=dict(eng.finished_by_reason),
            spec_num_drafts=s.spec_num_drafts,
            spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            adds_drained=self._adds_drained,
            kv_store=s.kv_store,
            time=now,
            **s.loras,
        )
