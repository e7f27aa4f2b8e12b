"""The workload's matrix-product floor for ``pagedserve bench throughput``.

The engine records each step's token count T and sampled rows S; the floor is the time
of the model's own linear layers alone at those shapes (every layer's fused qkv, o,
gate_up and down at T rows, the lm_head at S rows, ``F.linear``; weight-only quantized
weights through the engine's own quantized linear; a layer with experts: its router,
the experts its T tokens fill when routed evenly and its shared expert), timed on a grid of T and S and
interpolated per step. :func:`step_breakdown` splits a run's steps into
decode-only steps and steps with prefill, each against its share of the floor.
:func:`arithmetic_bound` counts the FLOPs of the same products (:func:`token_flops`) and
the time they take at a given multiply-add peak.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.loadtest.bench_common import StepRecord


def _grid(values: Sequence[int]) -> list[int]:
    """Token counts at which to time: every distinct value when few, else a geometric grid
    (ratio ~sqrt 2 up to 256, 2 above) spanning them."""
    distinct = sorted(set(values))
    if len(distinct) <= 12:
        return distinct
    lo, hi = distinct[0], distinct[-1]
    pts = {lo, hi}
    x = 1.0
    while x < hi:
        if x > lo:
            pts.add(int(round(x)))
        x *= math.sqrt(2) if x < 256 else 2.0
    return sorted(pts)


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    """Piecewise-linear interpolation, linear extrapolation through the origin past the end."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def _best_time(fn: Callable[[], None], warm: Callable[[], None], budget_s: float = 0.25,
               max_reps: int = 5) -> float:
    """Minimum wall time of ``fn`` over a few repetitions after one ``warm`` call."""
    warm()
    best = math.inf
    spent = 0.0
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
        if spent >= budget_s:
            break
    return best


def linear_floor(model, steps: Sequence[StepRecord],
                 linear: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Time of the model's linear layers alone at the token counts of ``steps``.

    For each step with T tokens and S sampled rows: every layer's fused qkv, o, gate_up
    and down projections at T rows, and the lm_head at S rows, with the model's own
    weights (``linear``, default ``F.linear``; pass the engine's ``ops.linear`` for
    quantized weights). Timed on a grid of T and S and interpolated per step.
    """
    import torch

    with torch.inference_mode():
        return _linear_floor(model, steps, linear)


def _linear_floor(model, steps: Sequence[StepRecord], linear) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    spec = model.spec
    layers = list(model.layers)
    w0 = layers[0].qkv_proj.weight
    dtype = w0.dtype if isinstance(w0, torch.Tensor) else torch.float32
    device = w0.device
    lin = linear or F.linear
    head_w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    q_size = spec.num_heads * spec.head_dim

    def stack(t: int, num_layers: int | None = None) -> Callable[[], None]:
        x = torch.randn(t, spec.hidden_size, dtype=dtype, device=device)
        xo = torch.randn(t, q_size, dtype=dtype, device=device)
        xd = torch.randn(t, spec.intermediate_size, dtype=dtype, device=device)

        def run() -> None:
            for layer in layers[:num_layers]:
                lin(x, layer.qkv_proj.weight, layer.qkv_proj.bias)
                lin(xo, layer.o_proj.weight, layer.o_proj.bias)
                if layer.moe is None:
                    lin(x, layer.gate_up_proj.weight, layer.gate_up_proj.bias)
                    lin(xd, layer.down_proj.weight, layer.down_proj.bias)
                else:
                    _experts(layer.moe, x, lin)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    def head(s: int) -> Callable[[], None]:
        h = torch.randn(s, spec.hidden_size, dtype=dtype, device=device)

        def run() -> None:
            lin(h, head_w)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    t0 = time.perf_counter()
    ts = [s.num_tokens for s in steps if s.num_tokens > 0]
    ss = [s.num_sampled for s in steps if s.num_sampled > 0]
    grid_t = _grid(ts)
    grid_s = _grid(ss)
    layer_times = [_best_time(stack(t), stack(t, None if t <= 256 else 1)) for t in grid_t]
    head_times = [_best_time(head(s), head(s)) for s in grid_s]
    layers_s = sum(_interp(t, grid_t, layer_times) for t in ts) if ts else 0.0
    head_s = sum(_interp(s, grid_s, head_times) for s in ss) if ss else 0.0
    return {
        "floor_s": layers_s + head_s,
        "layers_s": layers_s,
        "lm_head_s": head_s,
        "grid_tokens": grid_t,
        "grid_layer_times_s": layer_times,
        "grid_sampled": grid_s,
        "grid_lm_head_times_s": head_times,
        "timing_cost_s": time.perf_counter() - t0,
        "_interp": (grid_t, layer_times, grid_s, head_times),
    }


def token_flops(spec) -> tuple[int, int]:
    """FLOPs (two a multiply-add) of one token through every layer's projections (qkv,
    o, and the MLP: gate_up and down, or a layer's router, ``top_k`` experts and shared
    expert), and of one sampled row through the lm_head."""
    h = spec.hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attn = h * (q + 2 * kv) + q * h
    dense = 3 * h * spec.intermediate_size
    moe, sparse = spec.moe, dense
    if moe is not None:
        sparse = h * moe.num_experts + moe.top_k * 3 * h * moe.intermediate_size
        if moe.shared_intermediate_size:
            sparse += 3 * h * moe.shared_intermediate_size + h  # and its one-row gate
    experts = set(moe.layers) if moe is not None else set()
    layers = sum(attn + (sparse if i in experts else dense) for i in range(spec.num_layers))
    return 2 * layers, 2 * h * spec.vocab_size


def arithmetic_bound(spec, steps: Sequence[StepRecord], peak_gflops: float,
                     kv_bytes_per_token: int | None = None,
                     read_gbs: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The time the matrix products of the tokens ``steps`` computed take at
    ``peak_gflops``, the CPU's multiply-add peak: a bound no engine computing the same
    products can beat on this host (attention and everything else left out). Without
    preemptions (recomputed tokens count) and prefix-cache hits (cached ones do not),
    these are exactly the workload's products.

    With ``kv_bytes_per_token`` and ``read_gbs`` (the host's read bandwidth, GB/s), also
    the time the attention's reads of K/V take at that bandwidth (each step reads its
    requests' whole context once), and ``bound_with_kv_s``: the products at the peak
    plus those reads, a bound for an engine that does not overlap the two."""
    per_token, per_row = token_flops(spec)
    layers = per_token * sum(s.num_tokens for s in steps)
    head = per_row * sum(s.num_sampled for s in steps)
    out = {"matmul_flops": layers + head, "layers_flops": layers, "lm_head_flops": head,
           "fma_peak_gflops": peak_gflops, "bound_s": (layers + head) / (peak_gflops * 1e9)}
    if kv_bytes_per_token and read_gbs:
        kv = kv_bytes_per_token * sum(s.context_tokens for s in steps)
        out.update(kv_read_bytes=kv, read_gbs=read_gbs, kv_read_s=kv / (read_gbs * 1e9),
                   bound_with_kv_s=out["bound_s"] + kv / (read_gbs * 1e9))
    return out


def step_breakdown(steps: Sequence[StepRecord], floor: dict[str, Any] | None) -> dict[str, Any]:
    """Time of pure-decode steps vs steps with prefill, each against its floor."""
    dec = [s for s in steps if s.num_tokens > 0 and s.num_decodes == s.num_tokens]
    pre = [s for s in steps if s.num_tokens > 0 and s.num_decodes != s.num_tokens]
    out: dict[str, Any] = {
        "decode_steps": len(dec),
        "decode_time_s": sum(s.seconds for s in dec),
        "prefill_steps": len(pre),
        "prefill_time_s": sum(s.seconds for s in pre),
    }
    if dec:
        full = max(s.num_tokens for s in dec)
        at_full = [s.seconds for s in dec if s.num_tokens == full]
        out["decode_batch_max"] = full
        out["decode_step_median_s_at_max"] = statistics.median(at_full)
    if floor is not None:
        gt, lt, gs, hs = floor["_interp"]

        def f(group: list[StepRecord]) -> float:
            return sum(_interp(s.num_tokens, gt, lt)
                       + (_interp(s.num_sampled, gs, hs) if s.num_sampled else 0.0)
                       for s in group)
        out["decode_floor_s"] = f(dec)
        out["prefill_floor_s"] = f(pre)
        if dec:
            out["decode_step_floor_s_at_max"] = (
                _interp(full, gt, lt) + _interp(full, gs, hs))
    return out


def _experts(moe, x, lin) -> None:
    """A layer's experts on ``x``'s tokens routed evenly: each token's ``top_k`` choices
    spread over as many experts as they can fill, then the shared expert on all."""
    t, spec = x.shape[0], moe.spec
    used = min(spec.num_experts, t * spec.top_k)
    rows = -(-t * spec.top_k // used)
    lin(x, moe.gate.weight)
    xe = x[:1].expand(rows, -1).contiguous()
    for mlp in list(moe.experts)[:used] + ([moe.shared_expert] if moe.shared_expert else []):
        xi = x if mlp is moe.shared_expert else xe
        gu = lin(xi, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        lin(gu[:, : gu.shape[1] // 2], mlp.down_proj.weight, mlp.down_proj.bias)
