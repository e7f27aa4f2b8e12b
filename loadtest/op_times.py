"""Where a benchmark run's time goes: ``pagedserve bench throughput --op-times``.

:class:`OpTimes` wraps the attention backend's ``forward`` and each of its layer ops
(``ops.linear`` per weight, ``rms_norm``, ``add_rms_norm``, ``rope``, ``silu_mul``)
with a wall-clock timer, and sorts the time into decode-only steps and
steps with prefill (told apart by the scheduler's output, as the step breakdown does).
What a phase's steps took beyond its timed ops is the rest: the layers' Python, the
embedding, sampling (its argmax is bound when the engine is built, so it stays
untimed), scheduling and detokenization. Each call costs the timer about a
microsecond, so a run with ``--op-times`` is slightly slower than one without.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

LAYER_OPS = ("rms_norm", "add_rms_norm", "rope", "silu_mul")
PHASES = ("decode", "prefill")


def _weight_names(model: Any) -> dict[int, str]:
    """``id(weight)`` -> the projection's name (``qkv_proj``, ..., ``lm_head``)."""
    names: dict[int, str] = {}
    for layer in getattr(model, "layers", ()):
        for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            names[id(getattr(layer, proj).weight)] = proj
    head = model.lm_head if getattr(model, "lm_head", None) is not None \
        else model.embed_tokens  # fmt: skip
    names[id(head.weight)] = "lm_head"
    return names


class OpTimes:
    """Timers on one engine's attention backend, its ops and its scheduler, until
    :meth:`remove`."""

    def __init__(self, engine: Any) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self._phase = "decode"
        self._patched: list[tuple[Any, str]] = []
        attn = engine.worker.attn
        names = _weight_names(engine.worker.model)

        def linear_key(args: tuple, kwargs: dict) -> str:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            return f"linear {names.get(id(weight), tuple(weight.shape))}"

        self._wrap(attn, "forward", lambda a, k: "attention")
        self._wrap(attn.ops, "linear", linear_key)
        for name in LAYER_OPS:
            self._wrap(attn.ops, name, lambda a, k, name=name: name)
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            counts = out.num_scheduled_tokens.values()
            self._phase = "decode" if all(n == 1 for n in counts) else "prefill"
            return out

        scheduler.schedule = timed_schedule
        self._patched.append((scheduler, "schedule"))

    def _wrap(self, obj: Any, name: str, key: Callable[[tuple, dict], str]) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                k = (self._phase, key(args, kwargs))
                self.seconds[k] += time.perf_counter() - t0
                self.calls[k] += 1

        setattr(obj, name, timed)
        self._patched.append((obj, name))

    def remove(self) -> None:
        """Take every timer off (the instance attributes that shadow the methods)."""
        for obj, name in reversed(self._patched):
            obj.__dict__.pop(name, None)
        self._patched.clear()

    def report(self, phase_seconds: dict[str, float]) -> dict[str, Any]:
        """Per phase: each op's seconds and calls (largest first), their sum, and the
        rest of the phase's step time (``phase_seconds``: ``decode``/``prefill``)."""
        out: dict[str, Any] = {}
        for phase in PHASES:
            ops = sorted(((k[1], s, self.calls[k]) for k, s in self.seconds.items()
                          if k[0] == phase), key=lambda x: -x[1])  # fmt: skip
            total = sum(s for _, s, _ in ops)
            out[phase] = {
                "ops": [{"op": op, "seconds": s, "calls": n} for op, s, n in ops],
                "ops_s": total,
                "steps_s": phase_seconds[phase],
                "rest_s": phase_seconds[phase] - total,
            }
        return out


def format_report(report: dict[str, Any]) -> str:
    lines = ["-- op times (timers on every layer op and attention call) --"]
    for phase in PHASES:
        r = report[phase]
        label = "decode-only steps" if phase == "decode" else "steps with prefill"
        lines.append(f"{label}: {r['steps_s']:.2f} s")
        for op in r["ops"]:
            lines.append(f"  {op['op']:<24} {op['seconds']:7.2f} s  {op['calls']:6d} calls")
        lines.append(f"  {'rest (Python, sampling)':<24} {r['rest_s']:7.2f} s")
    return "\n".join(lines)
