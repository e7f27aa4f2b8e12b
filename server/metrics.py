"""Prometheus metrics, named ``pagedserve:*`` after vLLM's ``vllm:*`` names.

Engine counters and gauges are read from the engine thread's latest
:class:`~pagedserve.engine.loop.async_engine.EngineSnapshot` at scrape time (a custom collector);
per-request latencies are histograms observed on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve import EngineSnapshot, RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _Each:
    """One attribute of every snapshot: ``s.kv_usage`` is the list of each replica's."""

    def __init__(self, snaps: list[EngineSnapshot]) -> None:
        self._snaps = snaps

    def __getattr__(self, name: str) -> list:
        return [getattr(s, name) for s in self._snaps]


class _EngineCollector(Collector):
    """The engine's counters; with data-parallel replicas, one sample per replica,
    labelled ``replica``."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 replicas: Callable[[], list[EngineSnapshot]] | None = None) -> None:
        self.model_name = model_name
        self.snapshot = snapshot
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        if self.replicas is None:
            snaps, lbl = [self.snapshot()], ["model_name"]
            labels = [[self.model_name]]
        else:
            snaps, lbl = self.replicas(), ["model_name", "replica"]
            labels = [[self.model_name, str(i)] for i in range(len(snaps))]
        s = _Each(snaps)

        def gauge(name: str, doc: str, values: list[float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pagedserve:{name}", doc, labels=lbl)
            for m, v in zip(labels, values, strict=True):
                g.add_metric(m, v)
            return g

        def counter(name: str, doc: str, values: list[float]) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagedserve:{name}", doc, labels=lbl)
            for m, v in zip(labels, values, strict=True):
                c.add_metric(m, v)
            return c

        yield gauge("num_requests_running", "Sequences being generated.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                    s.kv_usage)
        yield counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("num_preemptions", "Preemptions (recomputation).", s.num_preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("spec_decode_num_drafts", "Request-steps that verified draft tokens "
                      "(speculative decoding).", s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                      s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.spec_num_accepted_tokens)
        done = CounterMetricFamily("pagedserve:request_success",
                                   "Finished sequences by finish reason.",
                                   labels=[*lbl, "finished_reason"])
        seen = set(FINISH_REASONS).union(*(x.finished_by_reason for x in snaps))
        for m, snap in zip(labels, snaps, strict=True):
            for reason in sorted(seen):
                done.add_metric([*m, reason], snap.finished_by_reason.get(reason, 0))
        yield done
        if any(x.kv_store for x in snaps):
            yield from _kv_store_metrics(snaps, labels, lbl)
        if any(x.max_loras for x in snaps):  # vLLM's lora_requests_info; the value: wall time
            info = GaugeMetricFamily(
                "pagedserve:lora_requests_info", "Running and waiting LoRA adapters.",
                labels=[*lbl, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            for m, snap in zip(labels, snaps, strict=True):
                info.add_metric([*m, str(snap.max_loras), ",".join(snap.running_loras),
                                 ",".join(snap.waiting_loras)], time.time())  # fmt: skip
            yield info


_KV_STORE_COUNTERS = (
    ("kv_store_hits", "tier_hits", "KV blocks found in the KV store past a prefix-cache miss."),
    ("kv_store_loads", "tier_loads", "KV store loads started (one per admission with hits)."),
    ("kv_store_loaded_blocks", "tier_placed", "KV blocks read from the KV store into the cache "
     "(served instead of computed)."),
    ("kv_store_saved_blocks", "tier_saved", "KV blocks the cache evicted and handed to the store."),
    ("kv_store_write_through_blocks", "tier_written_through", "KV blocks handed to the store "
     "as soon as they were computed (write-through)."),
    ("kv_store_dropped_writes", "store_dropped_writes", "KV blocks not stored: the store's "
     "write queue was full."),
)
_KV_TIER_COUNTERS = (
    ("kv_store_writes", "writes", "KV blocks written, by tier."),
    ("kv_store_reads", "loads", "KV blocks read, by tier."),
    ("kv_store_evictions", "evictions", "KV blocks evicted, by tier."),
    ("kv_store_bytes_written", "bytes_written", "Bytes written, by tier."),
    ("kv_store_bytes_read", "bytes_read", "Bytes read, by tier."),
    ("kv_store_skips", "skips", "Stored KV blocks that could not be served (damaged, "
     "foreign, vanished), by tier."),
)
_KV_TIERS = ("memory", "disk")


def _kv_store_metrics(snaps: list[EngineSnapshot], labels: list[list[str]],
                      lbl: list[str]) -> Iterator[Metric]:  # fmt: skip
    """The KV block store's counters (``pagedserve:kv_store_*``), per tier where the
    store has several."""
    for name, key, doc in _KV_STORE_COUNTERS:
        c = CounterMetricFamily(f"pagedserve:{name}", doc, labels=lbl)
        for m, snap in zip(labels, snaps, strict=True):
            c.add_metric(m, snap.kv_store.get(key, 0))
        yield c
    tiers = [t for t in _KV_TIERS if any(f"{t}_enabled" in x.kv_store for x in snaps)]
    for name, key, doc in _KV_TIER_COUNTERS:
        c = CounterMetricFamily(f"pagedserve:{name}", doc, labels=[*lbl, "tier"])
        for m, snap in zip(labels, snaps, strict=True):
            for t in tiers:
                c.add_metric([*m, t], snap.kv_store.get(f"{t}_{key}", 0))
        yield c
    for name, key, doc in (("kv_store_bytes_used", "bytes_used", "Bytes held, by tier."),
                           ("kv_store_blocks", "blocks", "KV blocks held, by tier.")):
        g = GaugeMetricFamily(f"pagedserve:{name}", doc, labels=[*lbl, "tier"])
        for m, snap in zip(labels, snaps, strict=True):
            for t in tiers:
                g.add_metric([*m, t], snap.kv_store.get(f"{t}_{key}", 0))
        yield g


class ServerMetrics:
    """The server's own registry (never the global one)."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 replicas: Callable[[], list[EngineSnapshot]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(model_name, snapshot, replicas))
        lbl = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagedserve:{name}", doc, labelnames=lbl, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between generated tokens.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                        _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Time from arrival to first scheduling.", _LATENCY_BUCKETS)

    def observe_first_token(self, m: RequestMetrics | None) -> None:
        """Record the time to first token of a request that just produced it."""
        if m is not None and m.time_to_first_token is not None:
            self.ttft.observe(max(0.0, m.time_to_first_token))

    def observe_finished(self, m: RequestMetrics | None) -> None:
        """Record the queue time and end-to-end latency of a finished request."""
        if m is None:
            return
        if m.queue_time is not None:
            self.queue_time.observe(max(0.0, m.queue_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
