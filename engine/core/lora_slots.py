"""The scheduler's LoRA questions: which adapters a step holds (at most ``max_loras``),
whether a waiting request's adapter finds a place (and when the places are drained for
one that has waited long), and which running requests an urgent one may preempt for a
place. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.engine.core.request import Request


def active_loras(running: Iterable[Request]) -> set[int]:
    """The adapter ids of the running requests."""
    return {r.lora_int_id for r in running} - {0}


def lora_admits(req: Request, active: set[int], max_loras: int) -> bool:
    """Whether ``req``'s adapter (if any) fits beside the ``active`` ones."""
    lid = req.lora_int_id
    return not lid or lid in active or len(active) < max_loras


LORA_WAIT_STEPS = 32
"""Steps the first waiting request may wait first in line for a place for its adapter
while requests behind it are admitted. After that a step admits only requests of the
base model and of that adapter (and preempts for no other): the running adapters'
requests finish, and the first to free its place gives it to the waiting one (under
steady traffic of other adapters it would wait for ever)."""


@dataclass
class LoRAGate:
    """One step's rule for admitting waiting requests (:func:`lora_gate`)."""

    max_loras: int
    drain_for: int | None = None
    """The adapter whose request has waited too long: only it and the base model pass."""

    def closed_to(self, req: Request) -> bool:
        """Whether the step admits no request of ``req``'s adapter, whatever the places."""
        return self.drain_for is not None and req.lora_int_id not in (0, self.drain_for)

    def admits(self, req: Request, active: set[int]) -> bool:
        """Whether ``req`` may be admitted beside the step's ``active`` adapters."""
        return not self.closed_to(req) and lora_admits(req, active, self.max_loras)

    def admitted(self, req: Request, active: set[int]) -> None:
        """``req`` was admitted: its adapter is active, its wait is over."""
        req.lora_waited_steps = 0
        if req.lora_int_id:
            active.add(req.lora_int_id)


def lora_gate(waiting, running: Iterable[Request], max_loras: int) -> LoRAGate:
    """The step's :class:`LoRAGate`: closed to other adapters once the first waiting
    request (``waiting.first()``) has waited :data:`LORA_WAIT_STEPS` steps first in line
    for a place. Called once a step, before any preemption or admission."""
    gate = LoRAGate(max_loras)
    head = waiting.first()
    if head is not None and not lora_admits(head, active_loras(running), max_loras):
        head.lora_waited_steps += 1
        if head.lora_waited_steps > LORA_WAIT_STEPS:
            gate.drain_for = head.lora_int_id
    return gate


def lora_victims(head: Request, running: list[Request]) -> list[Request]:
    """The running requests of the adapter whose requests are all less urgent than
    ``head`` (the adapter with the fewest of them): preempted, they leave its place to
    ``head``'s adapter. Empty when every active adapter has a request as urgent."""
    by_adapter: dict[int, list[Request]] = {}
    for r in running:
        if r.lora_int_id:
            by_adapter.setdefault(r.lora_int_id, []).append(r)
    prio = head.params.priority
    free = [reqs for reqs in by_adapter.values() if all(r.params.priority > prio for r in reqs)]
    return min(free, key=len, default=[])


def lora_names(scheduler) -> dict:
    """The adapters of a scheduler's running and waiting requests by name (sorted), and
    its ``max_loras``: the engine snapshot's LoRA fields (none when LoRA is off)."""
    if not scheduler.max_loras:
        return {}

    def names(reqs: Iterable[Request]) -> tuple[str, ...]:
        return tuple(sorted({r.lora_request.lora_name for r in reqs if r.lora_request}))

    return {"max_loras": scheduler.max_loras, "running_loras": names(scheduler.running),
            "waiting_loras": names(scheduler.waiting)}
