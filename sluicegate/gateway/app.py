"""``create_app``: the gateway's wiring — services in the lifespan, routes, error handlers.

The request path stays thin on purpose: no middleware stack, the key check is a guard, and the
``x-request-id`` header (and the HTTP server span, when tracing is on) rides on a ``before_send``
hook, which also sees responses produced by exception handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from litestar import Litestar
from litestar import Router as HttpRouter
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.types import Message, Scope
from opentelemetry.trace import Span, StatusCode
from redis.exceptions import RedisError

from sluicegate.engine.redis_client import async_client, pubsub_client
from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.admission.speculation import HeadroomBook
from sluicegate.gateway.api.admin import ADMIN_CONTROLLERS
from sluicegate.gateway.api.admin.guards import admin_guard, master_guard
from sluicegate.gateway.api.anthropic_messages import MessagesController
from sluicegate.gateway.api.error_handlers import EXCEPTION_HANDLERS
from sluicegate.gateway.api.health import HealthController
from sluicegate.gateway.api.key_info import KeyInfoController
from sluicegate.gateway.api.openai_chat import ChatCompletionsController
from sluicegate.gateway.api.openai_completions import CompletionsController
from sluicegate.gateway.api.openai_embeddings import EmbeddingsController
from sluicegate.gateway.api.openai_models import ModelsController
from sluicegate.gateway.api.openai_responses import ResponsesController
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.db.usage_reports import DatabaseSpend
from sluicegate.gateway.http.body import check_body
from sluicegate.gateway.http.fast_lane import FastLane
from sluicegate.gateway.keys.cache import KeyCache
from sluicegate.gateway.keys.throttle import FailureThrottle
from sluicegate.gateway.leases.book import LeaseBook
from sluicegate.gateway.redis.direct import Address, DirectConnection
from sluicegate.gateway.routing.adapters import AdapterBook, aliases_from_config
from sluicegate.gateway.routing.router import Router
from sluicegate.gateway.services import Services, new_request_id, request_state
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.stored.retention import ResponseRetention
from sluicegate.gateway.stored.store import ResponseStore
from sluicegate.gateway.telemetry import metrics_endpoint, serve_metrics, setup_tracing
from sluicegate.gateway.ui import SECURITY_HEADERS as UI_SECURITY_HEADERS
from sluicegate.gateway.ui import is_ui_path, template_config, ui_router
from sluicegate.gateway.usage.pricing import PriceBook, prices_from_config
from sluicegate.gateway.usage.stream import UsageFlusher, UsageRecorder

logger = logging.getLogger(__name__)

MASTER_ONLY = [admin_guard, master_guard]
REDIS_CONNECT_TIMEOUT_S = 1.0
REDIS_COMMAND_TIMEOUT_S = 5.0
"""Bounds every request-path Redis call, so a hung Redis becomes a prompt 503."""


async def _stamp_response(message: Message, scope: Scope) -> None:
    """``before_send`` hook: every response gets ``x-request-id``, the UI's its security
    headers; the server span ends."""
    if message["type"] == "http.response.start":
        state = request_state(scope)
        request_id = state.get("request_id")
        if request_id is None:
            request_id = state["request_id"] = new_request_id()
        headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
        # Here rather than on the UI's router, so that its 404s and static files get them too.
        if is_ui_path(scope["path"]):
            headers += UI_SECURITY_HEADERS
        message["headers"] = headers
        span: Span | None = state.get("server_span")
        if span is not None:
            status = message["status"]
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(StatusCode.ERROR)
    elif message["type"] == "http.response.body" and not message.get("more_body", False):
        span = request_state(scope).pop("server_span", None)
        if span is not None:
            span.end()


SHUTDOWN_STEP_TIMEOUT_S = 10.0
"""No shutdown step may hold the process: past this, the step is abandoned and named in the log."""


async def _bounded(step: str, closing: Coroutine[Any, Any, object]) -> None:
    # asyncio.wait, not wait_for: wait_for would wait on a step that ignores its cancellation.
    task = asyncio.ensure_future(closing)
    done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_STEP_TIMEOUT_S)
    if not done:
        task.cancel()
        logger.error(
            "shutdown: %s did not close within %.0fs; abandoned", step, SHUTDOWN_STEP_TIMEOUT_S
        )
    elif task.exception() is not None:
        logger.error("shutdown: %s failed: %r", step, task.exception())


GC_YOUNG_THRESHOLD = 10_000
"""Net container allocations between two collections of the youngest generation (Python's
default: 700). A request's objects die by reference counting; with 700, requests in flight
alone set off a young collection every few requests, and every tenth of those an older one."""


def tune_gc() -> None:
    """For a long-running server process, once started: freeze what startup made and collect
    the young generation less often.

    Startup leaves ~150k long-lived objects (SQLAlchemy, Litestar, the provider SDKs); every
    full collection walked them all, ~100 ms each, about a fifth of the gateway's CPU under
    load (bench/gateway_overhead.py). Frozen, they are never walked again."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def create_served_app() -> FastLane:
    """The app ``sluicegate gateway`` serves: ``create_asgi_app`` with the collector tuned once
    the lifespan has started (not for apps made in a shared process, such as tests)."""
    return create_asgi_app(served=True)


def create_asgi_app(settings: Settings | None = None, *, served: bool = False) -> FastLane:
    """``create_app`` behind its fast lane (``sluicegate.gateway.http.fast_lane``): what a server serves."""
    return FastLane(create_app(settings, served=served))


def create_app(settings: Settings | None = None, *, served: bool = False) -> Litestar:
    settings = settings or Settings.from_env()
    setup_tracing()
    # httpx logs every upstream call at INFO: a cost on each request, and noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        redis = async_client(
            settings.redis_url,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
            socket_timeout=REDIS_COMMAND_TIMEOUT_S,
        )
        # Subscriptions idle for long stretches, so they get a client without a read timeout.
        redis_pubsub = pubsub_client(
            settings.redis_url, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S
        )
        db_engine = create_engine(settings.database_url)
        sessionmaker = create_sessionmaker(db_engine)
        key_cache = KeyCache(redis_pubsub, sessionmaker, settings)
        adapters = AdapterBook(
            sessionmaker, settings.currency, aliases_from_config(settings.config)
        )
        prices = PriceBook(
            prices_from_config(settings.config, settings.currency), sessionmaker, adapters=adapters
        )
        address = Address.from_url(settings.redis_url)
        direct = (
            DirectConnection(
                address,
                connect_timeout_s=REDIS_CONNECT_TIMEOUT_S,
                timeout_s=REDIS_COMMAND_TIMEOUT_S,
            )
            if address is not None
            else None
        )
        limiter = RateLimiter(
            redis,
            slot_ttl_s=settings.request_timeout_s,
            spend=DatabaseSpend(sessionmaker),
            prices=prices,
            direct=direct,
            headroom=HeadroomBook(enabled=settings.speculative_dispatch),
        )
        router = Router.from_settings(settings, redis)
        flusher = (
            UsageFlusher(redis, sessionmaker, settings) if settings.run_usage_flusher else None
        )
        recorder = UsageRecorder(redis, settings)
        response_retention = (
            ResponseRetention(sessionmaker, settings.response_retention_days)
            if settings.response_retention_days > 0
            else None
        )
        leases = LeaseBook(redis, settings, limiter, recorder)
        services = Services(
            settings=settings,
            router=router,
            limiter=limiter,
            recorder=recorder,
            redis=redis,
            leases=leases,
            adapters=adapters,
        )
        app.state.update(
            settings=settings,
            redis=redis,
            db_engine=db_engine,
            db_sessionmaker=sessionmaker,
            key_cache=key_cache,
            admin_auth_throttle=FailureThrottle(settings.admin_auth_failures_per_min),
            router=router,
            prices=prices,
            adapters=adapters,
            limiter=limiter,
            services=services,
            response_store=ResponseStore(sessionmaker),
        )
        metrics_server = serve_metrics(settings) if settings.metrics_port else None
        try:
            await limiter.load()
        except RedisError as exc:
            logger.warning("Redis not reachable at start (%s); scripts load on first use", exc)
        await key_cache.start()
        if flusher is not None:
            await flusher.start()
        await leases.start()
        if response_retention is not None:
            await response_retention.start()
        if served:
            tune_gc()
        try:
            yield
        finally:
            await _bounded("settlements", services.drain_settlements())
            await _bounded("lease book", leases.stop())
            if response_retention is not None:
                await _bounded("response retention", response_retention.stop())
            if flusher is not None:
                await _bounded("usage flusher", flusher.stop())
            await _bounded("key cache", key_cache.stop())
            await _bounded("router", router.close())
            await _bounded("database pool", db_engine.dispose())
            await _bounded("redis pubsub client", redis_pubsub.aclose())
            await _bounded("redis client", redis.aclose())
            if direct is not None:
                await _bounded("request-path redis connection", direct.aclose())
            if metrics_server is not None:
                metrics_server.shutdown()
                metrics_server.server_close()

    # /metrics on its own port when one is set; else on this one, for the admin key only.
    metrics = (
        []
        if settings.metrics_port
        else [HttpRouter("/", route_handlers=[metrics_endpoint], guards=MASTER_ONLY)]
    )
    return Litestar(
        route_handlers=[
            ChatCompletionsController,
            MessagesController,
            ResponsesController,
            CompletionsController,
            EmbeddingsController,
            ModelsController,
            KeyInfoController,
            *ADMIN_CONTROLLERS,
            HealthController,
            *metrics,
            ui_router(),
        ],
        template_config=template_config(),
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        before_request=check_body,
        before_send=[_stamp_response],
        request_max_body_size=settings.max_body_bytes,
        cors_config=_cors(settings),
        openapi_config=OpenAPIConfig(
            title="Sluicegate",
            version="0.1.0",
            description="OpenAI-compatible gateway in front of Sluicegate engines and upstreams.",
            path="/schema",
            openapi_router=HttpRouter(
                "/schema",
                route_handlers=[],
                guards=[] if settings.expose_schema else MASTER_ONLY,
                include_in_schema=False,
            ),
        ),
        state=State({"settings": settings}),
    )


def _cors(settings: Settings) -> CORSConfig | None:
    origins = [o.strip() for o in settings.cors_allow_origins.split(",") if o.strip()]
    if not origins:
        return None
    return CORSConfig(
        allow_origins=origins,
        allow_methods=["GET", "POST", "PATCH", "DELETE", "OPTIONS"],
        allow_headers=["authorization", "content-type", "x-request-id", "traceparent"],
        expose_headers=["x-request-id", "retry-after", "x-ratelimit-remaining-requests"],
        max_age=600,
    )
