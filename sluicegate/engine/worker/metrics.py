"""An engine worker's Prometheus metrics and its small HTTP endpoint.

Names follow vLLM's (``vllm:`` becomes ``sluicegate:``) so existing dashboards port over.
The endpoint serves ``/metrics``, ``/health/live`` (the process answers) and ``/health/ready``
(the model is loaded and the worker pulls requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

logger = logging.getLogger(__name__)

PORT_SEARCH_SPAN = 100
"""How many ports after a taken ``--metrics-port`` are tried before giving up."""

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class WorkerMetrics:
    """The worker's metrics, on a registry of their own (several workers may share a process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge(
            "sluicegate:num_requests_running", "Requests in the running batch."
        ).labels(model_name)
        self.num_requests_waiting = gauge(
            "sluicegate:num_requests_waiting", "Requests waiting to be scheduled."
        ).labels(model_name)
        self.kv_cache_usage_perc = gauge(
            "sluicegate:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."
        ).labels(model_name)
        self.num_preemptions = counter(
            "sluicegate:num_preemptions", "Preemptions since the worker started."
        ).labels(model_name)
        self.prefix_cache_queries = counter(
            "sluicegate:prefix_cache_queries", "Prefix-cache lookups (as the engine counts them)."
        ).labels(model_name)
        self.prefix_cache_hits = counter(
            "sluicegate:prefix_cache_hits", "Prefix-cache hits (as the engine counts them)."
        ).labels(model_name)
        self.spec_draft_tokens = counter(
            "sluicegate:spec_decode_num_draft_tokens", "Speculative draft tokens proposed."
        ).labels(model_name)
        self.spec_accepted_tokens = counter(
            "sluicegate:spec_decode_num_accepted_tokens",
            "Speculative draft tokens the model accepted.",
        ).labels(model_name)
        self.spec_acceptance_rate = gauge(
            "sluicegate:spec_decode_acceptance_rate",
            "Accepted over proposed draft tokens since the worker started (0 to 1).",
        ).labels(model_name)
        self.prompt_tokens = counter(
            "sluicegate:prompt_tokens", "Prompt tokens of finished requests."
        ).labels(model_name)
        self.generation_tokens = counter(
            "sluicegate:generation_tokens", "Tokens generated."
        ).labels(model_name)
        self.time_to_first_token = histogram(
            "sluicegate:time_to_first_token_seconds",
            "Seconds from pulling a request to its first token.",
            _LATENCY_BUCKETS,
        ).labels(model_name)
        self.inter_token_latency = histogram(
            "sluicegate:inter_token_latency_seconds",
            "Seconds between consecutive output deltas of one request.",
            _LATENCY_BUCKETS,
        ).labels(model_name)
        self.e2e_request_latency = histogram(
            "sluicegate:e2e_request_latency_seconds",
            "Seconds from pulling a request to its last token.",
            _E2E_BUCKETS,
        ).labels(model_name)
        self._seen: dict[str, float] = {}

    def observe_engine_stats(self, stats: Mapping[str, Any]) -> None:
        """Copy a snapshot of ``AsyncEngine.stats()`` into the gauges and monotonic counters."""
        self.num_requests_running.set(stats.get("num_running", 0))
        self.num_requests_waiting.set(stats.get("num_waiting", 0))
        total = stats.get("kv_blocks_total") or 0
        self.kv_cache_usage_perc.set(stats.get("kv_blocks_used", 0) / total if total else 0.0)
        self.spec_acceptance_rate.set(stats.get("spec_acceptance_rate", 0.0) or 0.0)
        for key, metric in (
            ("num_preemptions", self.num_preemptions),
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
            ("spec_draft_tokens", self.spec_draft_tokens),
            ("spec_accepted_tokens", self.spec_accepted_tokens),
        ):
            value = float(stats.get(key, 0) or 0)
            increase = value - self._seen.get(key, 0.0)
            if increase > 0:
                metric.inc(increase)
            self._seen[key] = value

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """``/metrics`` and the two health probes over plain HTTP/1.1, on the worker's event loop."""

    def __init__(self, metrics: WorkerMetrics, host: str = "0.0.0.0", port: int = 9100) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.ready = False
        self.refresh: Callable[[], None] | None = None
        """Called before each scrape, so gauges are current rather than a heartbeat old."""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listens on ``port``, or on the next free one when it is taken (a second worker on
        the same host), logging the one it got; ``port`` 0 picks any free port."""
        wanted = self.port
        for port in range(wanted, wanted + PORT_SEARCH_SPAN) if wanted else [0]:
            try:
                self._server = await asyncio.start_server(self._handle, self.host, port)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        else:
            raise OSError(
                errno.EADDRINUSE,
                f"metrics ports {wanted}-{wanted + PORT_SEARCH_SPAN - 1} are all taken; "
                "choose one with --metrics-port (0 picks any free port)",
            )
        sockets = self._server.sockets or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        if wanted and self.port != wanted:
            logger.warning(
                "metrics port %d is taken; serving /metrics and health on %d instead "
                "(choose one with --metrics-port)",
                wanted,
                self.port,
            )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            status, content_type, body = self._respond(path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()

    def _respond(self, path: str) -> tuple[str, str, bytes]:
        if path == "/metrics":
            if self.refresh is not None:
                try:
                    self.refresh()
                except Exception:
                    logger.exception("refreshing metrics failed")
            return "200 OK", CONTENT_TYPE_LATEST, self.metrics.exposition()
        if path == "/health/live":
            return "200 OK", "application/json", b'{"status":"live"}'
        if path == "/health/ready":
            if self.ready:
                return "200 OK", "application/json", b'{"status":"ready"}'
            return "503 Service Unavailable", "application/json", b'{"status":"loading"}'
        return "404 Not Found", "application/json", b'{"error":"not found"}'
