"""Prometheus metrics for one server, in its own CollectorRegistry (no global registry state).

Request-level numbers (counts, TTFT, inter-token latency) are observed in the HTTP process as
outputs arrive. Cache and queue numbers live in the scheduler process: /metrics fetches a fresh
/cache_stats snapshot and a collector reports it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _CacheCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        gauges = {
            "lazyrt_num_running_requests": ("requests being decoded or prefilled", "running_requests"),
            "lazyrt_num_waiting_requests": ("requests waiting for KV pages", "waiting_requests"),
            "lazyrt_kv_pages_total": ("KV pages in the pool", "total_pages"),
            "lazyrt_kv_pages_free": ("free KV pages", "free_pages"),
            "lazyrt_kv_pages_held": ("KV pages held by running requests", "held_pages"),
            "lazyrt_kv_pages_chunk": ("KV pages holding document chunks", "chunk_pages"),
            "lazyrt_kv_pages_radix": ("KV pages in the radix prefix cache", "radix_pages"),
            "lazyrt_host_kv_pages_total": ("pages of the host KV tier (0 = off)", "host_total_pages"),
            "lazyrt_host_kv_pages_free": ("free pages of the host KV tier", "host_free_pages"),
        }
        for name, (doc, key) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily(
            "lazyrt_kv_pages_used", "KV pages not free", value=s["total_pages"] - s["free_pages"]
        )
        counters = {
            "lazyrt_chunk_hits": ("document chunks served from the chunk table", "chunk_hits"),
            "lazyrt_chunk_misses": ("document chunks that had to be computed", "chunk_misses"),
            "lazyrt_chunk_evictions": ("document chunks evicted from the device KV cache", "chunk_evictions"),
            "lazyrt_chunk_device_hits": ("document chunks found in the device KV cache", "chunk_device_hits"),
            "lazyrt_chunk_host_hits": ("document chunks found in the host KV tier", "chunk_host_hits"),
            "lazyrt_chunk_offloads": ("document chunks copied to the host KV tier", "chunk_offloads"),
            "lazyrt_chunk_loads": ("document chunks copied from the host KV tier", "chunk_loads"),
            "lazyrt_chunk_host_attended": ("document chunk uses attended in the host KV tier (retrieval "
                                           "attention)", "chunk_host_attended"),
            "lazyrt_chunk_host_evictions": ("document chunks dropped from the host KV tier",
                                            "chunk_host_evictions"),
            "lazyrt_host_offload_bytes": ("KV bytes copied device -> host", "host_offload_bytes"),
            "lazyrt_host_load_bytes": ("KV bytes copied host -> device", "host_load_bytes"),
            "lazyrt_radix_hit_tokens": (
                "prompt tokens served from the radix prefix cache",
                "radix_hit_tokens",
            ),
            "lazyrt_steps": ("model steps run", "steps"),
            "lazyrt_overlapped_steps": ("steps built while the previous one ran (overlapped scheduling)",
                                        "overlapped_steps"),
            "lazyrt_shared_chunk_steps": ("steps that read each shared document once for all its users",
                                          "shared_chunk_steps"),
            "lazyrt_graph_steps": ("steps replayed from a CUDA graph", "graph_steps"),
            "lazyrt_ragged_prefill_steps": ("lazy steps that computed new tokens through FlashInfer's ragged "
                                            "prefill (--lazy-flashinfer-prefill)", "ragged_prefill_steps"),
            "lazyrt_decode_split_steps": ("lazy steps (or parts) that launched their decodes apart from "
                                          "longer sequences", "decode_split_steps"),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=s[key])


# lazyrt_request_errors' endpoint label by path (first match)
_ENDPOINT_LABELS = (
    ("/v1/chat/completions", "chat"),
    ("/v1/completions", "completions"),
    ("/generate", "generate"),
    ("/score", "score"),
    ("/v1/documents", "documents"),
)


def endpoint_label(path: str) -> str:
    for prefix, label in _ENDPOINT_LABELS:
        if path == prefix or path.startswith(prefix + "/"):
            return label
    return "other"


class ErrorCounter:
    """ASGI middleware: every 4xx / 5xx answer counted in lazyrt_request_errors by endpoint, whoever
    answered it (a route, FastAPI, or an exception no route caught: a 500); 499 (the client went away)
    is lazyrt_requests_aborted's. An error streamed after a 200 is counted where it is sent."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                if status >= 400 and status != 499:
                    self.metrics.errors.labels(endpoint_label(scope["path"]), str(status)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting)
        except Exception:
            if not started:  # the server's outermost handler answers it with a 500
                self.metrics.errors.labels(endpoint_label(scope["path"]), "500").inc()
            raise


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lazyrt_requests", "finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.errors = Counter(
            "lazyrt_request_errors", "requests answered with an error", ["endpoint", "status"], registry=r
        )
        self.aborts = Counter("lazyrt_requests_aborted", "requests whose client went away", registry=r)
        self.prompt_tokens = Counter("lazyrt_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("lazyrt_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter(
            "lazyrt_cached_prompt_tokens", "prompt tokens served from cache", registry=r
        )
        self.ttft = Histogram(
            "lazyrt_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "lazyrt_inter_token_latency_seconds", "time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "lazyrt_e2e_request_latency_seconds", "request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self._cache = _CacheCollector()
        r.register(self._cache)

    def render(self, cache_stats: dict) -> bytes:
        self._cache.stats = cache_stats
        return generate_latest(self.registry)
