"""The scheduler's LoRA questions: which adapters a step holds (at most ``max_loras``),
whether a waiting request's adapter finds a place (and when the places are drained for
one that has waited long), and which running requests an urgent one may preempt for a
place. Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.request import Request


def active_loras(running: Iterable[Request]) -> set[int]:
    """The adapter ids of the running requests."""
    return {r.lora_int_id for r in running} - {0}


def lora_admits(req: Request, active: set[int], max_loras: int) -> bool:
    """Whether ``req``'s adapter (if any) fits beside the ``active`` ones."""
    lid = req.lora_int_id
    return not lid or lid in active or len(active) < max_loras


LORA_WAIT_STEPS = 32
"""Steps the first waiting request may wait for a place for its adapter while requests
behind it are admitted. After that a step admits only requests of the base model and of
that adapter: the running adapters' requests finish, and the first to free its place
gives it to the waiting one (under steady traffic of other adapters it would wait for
ever)."""


def lora_gate(waiting, active: set[int], max_loras: int) -> Callable[[Request], bool]:
    """Which waiting requests a step may admit: those whose adapter finds a place
    (:func:`lora_admits`), and once the first in line has waited :data:`LORA_WAIT_STEPS`
    steps for one, only requests of the base model and of its adapter. ``waiting`` is the
    scheduler's queue, ``active`` the step's adapters (updated as requests are admitted);
    called once a step."""
    head = waiting.first()
    if head is not None and not lora_admits(head, active, max_loras):
        head.lora_waited_steps += 1
        if head.lora_waited_steps > LORA_WAIT_STEPS:
            lid = head.lora_int_id
            return lambda r: not r.lora_int_id or (r.lora_int_id == lid
                                                   and lora_admits(r, active, max_loras))
    return lambda r: lora_admits(r, active, max_loras)


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
