"""Where a benchmark run's time goes: ``pagedserve bench throughput --op-times``.

:class:`OpTimes` runs the engine's layers through :class:`TimedBackend` (the model
runner's explicit :meth:`~pagedserve.engine.worker.model_runner.ModelRunner.instrument` seam: nothing of
the engine is patched): the same attention backend and layer ops, each call of
``forward``, ``ops.linear`` and ``ops.gated_linear`` (per weight), ``rms_norm``,
``add_rms_norm``, ``rope`` and ``silu_mul`` under a wall-clock timer, sorted into
decode-only steps and steps with prefill (told apart by the step's attention metadata:
every request one query token).
What a phase's steps took beyond its timed ops is the rest: the layers' Python, the
embedding, sampling (its argmax is the plain backend's, untimed), scheduling and
detokenization. Each call costs the timer about a microsecond, so a run with
``--op-times`` is slightly slower than one without.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

LAYER_OPS = ("rms_norm", "add_rms_norm", "rope", "silu_mul")
PHASES = ("decode", "prefill")


def _weight_names(model: Any) -> dict[int, str]:
    """``id(weight)`` -> the projection's name (``qkv_proj``, ..., ``lm_head``)."""
    names: dict[int, str] = {}
    for layer in getattr(model, "layers", ()):
        for name, proj in layer.linears():  # an expert's: moe.gate_up_proj, moe.down_proj
            names[id(proj.weight)] = name if "." not in name else \
                f"moe.{name.rpartition('.')[2]}"  # fmt: skip
        if layer.moe is not None:
            names[id(layer.moe.gate.weight)] = "moe.router"
            if layer.moe.shared_expert_gate is not None:
                names[id(layer.moe.shared_expert_gate.weight)] = "moe.router"
    head = model.lm_head if getattr(model, "lm_head", None) is not None \
        else model.embed_tokens  # fmt: skip
    names[id(head.weight)] = "lm_head"
    return names


class _Clock:
    """Seconds and calls per (phase, op)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.phase = "decode"

    def add(self, op: str, t0: float) -> None:
        key = (self.phase, op)
        self.seconds[key] += time.perf_counter() - t0
        self.calls[key] += 1


class TimedOps:
    """A ``LayerOps`` that times each call of another."""

    def __init__(self, ops: Any, clock: _Clock, weight_names: dict[int, str]) -> None:
        self._ops, self._clock, self._names = ops, clock, weight_names

    def linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        return self._timed_product(self._ops.linear, weight, x, weight, bias)

    def gated_linear(self, x: Any, weight: Any, bias: Any, gelu: bool) -> Any:
        # the product and its gate in one (the gate is no silu_mul call of its own)
        return self._timed_product(self._ops.gated_linear, weight, x, weight, bias, gelu)

    def _timed_product(self, fn: Any, weight: Any, *args: Any) -> Any:
        """``fn(*args)`` timed as ``linear <the weight's projection>``."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._clock.add(f"linear {self._names.get(id(weight), tuple(weight.shape))}", t0)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)
        if name not in LAYER_OPS:
            return fn  # embedding, argmax, prepare_weights: untimed
        clock = self._clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.add(name, t0)

        return timed


class TimedBackend:
    """An ``AttentionBackend`` that times another's ``forward`` and its layer ops."""

    def __init__(self, backend: Any, clock: _Clock, weight_names: dict[int, str]) -> None:
        self._backend, self._clock = backend, clock
        self.name = backend.name
        self.ops = TimedOps(backend.ops, clock, weight_names)

    def prepare(self, meta: Any, block_size: int) -> None:
        self._clock.phase = "decode" if meta.num_decodes == meta.num_reqs else "prefill"
        self._backend.prepare(meta, block_size)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._backend.forward(*args, **kwargs)
        finally:
            self._clock.add("attention", t0)


class OpTimes:
    """Timers on one engine's layers (through its model runner), until :meth:`remove`."""

    def __init__(self, engine: Any) -> None:
        self._clock = clock = _Clock()
        self.seconds, self.calls = clock.seconds, clock.calls
        self._runner = runner = engine.worker.runner
        names = _weight_names(engine.worker.model)
        runner.instrument(lambda backend: TimedBackend(backend, clock, names))

    def remove(self) -> None:
        """Run the engine's layers through its plain backend again."""
        self._runner.instrument(None)

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
