"""The scheduler's waiting queue, in the order of its scheduling policy.

``fcfs``: arrival order; a preempted request goes back to the head. ``priority``: by
:func:`priority_key` (lower ``priority`` first, then arrival), a preempted request at
its place among equals that arrived after it. Torch-free.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator

from pagedserve.engine.core.request import Request

POLICIES = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float, int]:
    """The priority policy's order: priority (lower first), arrival, sibling index."""
    return req.params.priority, req.arrival_time, req.index


class WaitingQueue:
    __slots__ = ("_q", "by_priority")

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy={policy!r} is invalid: must be one of "
                             f"{POLICIES}")
        self._q: deque[Request] = deque()
        self.by_priority = policy == "priority"

    def add(self, req: Request) -> None:
        """A request that arrived (or whose grammar compiled)."""
        if self.by_priority:
            bisect.insort_right(self._q, req, key=priority_key)
        else:
            self._q.append(req)

    def put_back(self, req: Request) -> None:
        """A preempted request."""
        if self.by_priority:
            bisect.insort_left(self._q, req, key=priority_key)
        else:
            self._q.appendleft(req)

    def first(self, admits: Callable[[Request], bool] | None = None) -> Request | None:
        """The first request ``admits`` (any by default), or None."""
        if admits is None:
            return self._q[0] if self._q else None
        return next((r for r in self._q if admits(r)), None)

    def popleft(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __getitem__(self, i: int) -> Request:
        return self._q[i]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)
