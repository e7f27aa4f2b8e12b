"""Compiles grammars off the engine thread and caches them by constraint.

:meth:`StructuredOutputManager.submit` returns a future at once; the request waits in
its own state (the scheduler skips it) until the future is done. Equal constraints share one
compile and one compiled grammar; a failed compile is cached too, so a bad constraint that is
sent again fails again at once. The backend itself (its tokenizer tables) is built on
the first compile, in the pool.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from pagedserve.engine.errors import StructuredOutputsError
from pagedserve.engine.structured.backend import (
    AUTO,
    Grammar,
    GrammarBackend,
    Matcher,
    check_enforced,
    choose_backend,
    is_available,
    load_backend,
)
from pagedserve.engine.structured.gate import GatedMatcher
from pagedserve.engine.structured.params import StructuredOutputsParams

logger = logging.getLogger("pagedserve.engine.structured")

MAX_CACHED_GRAMMARS = 512


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int], max_workers: int = 2) -> None:
        self.backend_name = backend
        if not is_available(backend):
            logger.warning("structured outputs backend %r is not installed: requests with "
                           "structured outputs will be refused", backend)
        self._args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[Grammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self.num_compiles = 0

    def backend(self, name: str | None = None) -> GrammarBackend:
        """The backend ``name`` (by default the configured one; xgrammar for ``auto``),
        loaded on first use."""
        name = name or ("xgrammar" if self.backend_name == AUTO else self.backend_name)
        with self._backend_lock:
            if name not in self._backends:
                self._backends[name] = load_backend(name, *self._args)
            return self._backends[name]

    def submit(self, constraint: StructuredOutputsParams) -> Future[Grammar]:
        """The (cached) compile of ``constraint``; its exception is a
        :class:`~pagedserve.engine.errors.StructuredOutputsError` naming the constraint's field."""
        key = constraint.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
            else:
                fut = self._pool.submit(self._compile, constraint)
                self._cache[key] = fut
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return _own(fut)

    def _compile(self, constraint: StructuredOutputsParams) -> Grammar:
        self.num_compiles += 1
        name = choose_backend(self.backend_name, constraint)
        check_enforced(constraint, name)
        return self.backend(name).compile(constraint)

    def matcher(self, constraint: StructuredOutputsParams) -> Matcher:
        """A new matcher of a compiled constraint (blocks if it is still compiling); with
        ``constraint.reasoning``, one that applies the grammar after the reasoning."""
        m = self.submit(constraint).result().matcher()
        return m if constraint.reasoning is None else GatedMatcher(m, constraint.reasoning)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _own(fut: Future[Grammar]) -> Future[Grammar]:
    """A caller's own future of a cached compile. A failed compile is cached and handed to
    every request that sends its constraint: each raise of one exception object adds its
    frames to the object's traceback, and those frames keep each raiser's locals (the
    request, its body) alive for as long as the failure stays cached. Each caller gets
    its own copy of the exception instead; and cancelling a caller's future (a client
    gone while it waited) cannot cancel the compile the cache shares."""
    if fut.done() and not fut.cancelled() and fut.exception() is None:
        return fut
    out: Future[Grammar] = Future()

    def settle(done: Future[Grammar]) -> None:
        try:
            if done.cancelled():
                out.cancel()
            elif (exc := done.exception()) is None:
                out.set_result(done.result())
            else:
                out.set_exception(_copied(exc))
        except InvalidStateError:  # the caller cancelled its own future first
            pass

    fut.add_done_callback(settle)
    return out


def _copied(exc: BaseException) -> BaseException:
    """``exc`` as a new object of its type and message, with no traceback."""
    try:
        fresh = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception type that cannot be rebuilt
        fresh = StructuredOutputsError(str(exc))
    fresh.__traceback__ = fresh.__cause__ = fresh.__context__ = None
    return fresh
