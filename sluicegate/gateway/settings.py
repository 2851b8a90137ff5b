"""One settings object, read from ``SLUICEGATE_*`` environment variables.

Defaults run on one machine (local PostgreSQL and Redis); production overrides them through
the environment, and the Helm values map onto the same names.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

logger = logging.getLogger(__name__)

_LIBPQ_SCHEMES = {"postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2"}


def asyncpg_database_url(url: str) -> str:
    """The URL with the asyncpg driver: ``postgresql://`` and ``postgres://`` (what every
    PostgreSQL tool prints) name no driver, and SQLAlchemy would pick psycopg, which the gateway
    does not ship. libpq's ``sslmode`` becomes asyncpg's ``ssl``."""
    parts = urlsplit(url)
    if parts.scheme not in _LIBPQ_SCHEMES:
        return url
    query = parts.query
    if "sslmode=" in query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([("ssl" if k == "sslmode" else k, v) for k, v in pairs])
    return urlunsplit(parts._replace(scheme="postgresql+asyncpg", query=query))


def _env_value(name: str, default: Any) -> Any:
    raw = os.environ.get(f"SLUICEGATE_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


@dataclass(frozen=True)
class Settings:
    database_url: str = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    redis_url: str = "redis://127.0.0.1:6379/0"
    master_key: str = ""
    """Admin bearer key; admin routes answer 401 to everyone while it is empty."""
    config: str = ""
    """Path to the routing YAML (public model names -> deployments)."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body, however it is framed (Content-Length or chunked)."""
    max_json_depth: int = 128
    """Deepest nesting of arrays/objects a JSON body may have (0 = no limit)."""
    expose_schema: bool = False
    """Serve the OpenAPI schema and its docs under /schema to everyone; else admin key only."""
    metrics_port: int = 0
    """> 0: serve /metrics (no auth) on this port only; 0: /metrics on the API port, admin key
    required."""
    metrics_host: str = "0.0.0.0"
    cors_allow_origins: str = ""
    """Comma-separated origins browsers may call from (``*`` for any); empty = no CORS."""
    request_timeout_s: float = 600.0
    """Deadline of one generation request, first byte to last token."""
    first_token_timeout_s: float = 60.0
    default_max_tokens: int = 1024
    key_cache_ttl_s: float = 30.0
    """Upper bound on how long a cached key lives even if an invalidation is missed."""
    invalid_key_lookups_per_min: int = 30
    """Database lookups of unknown keys one client address may cause per minute (0 = no cap);
    past it, its uncached keys get 429 without a query."""
    admin_auth_failures_per_min: int = 10
    """Wrong admin keys (master or team admin, API or UI sign-in) one client address may send
    per minute (0 = no cap); past it, all its admin authentications get 429 until the minute
    ends."""
    trusted_proxy_count: int = 0
    """Proxies in front of the gateway that append to ``client_address_header``; the client's
    address is the entry this many from the right, the one the outermost of them saw.
    0 = the TCP peer, and the header is not read."""
    client_address_header: str = "x-forwarded-for"
    """The header the trusted proxies append the client's address to (read only while
    ``trusted_proxy_count`` > 0)."""
    key_info_requests_per_min: int = 60
    """Requests to ``/v1/key/info`` one key may make per minute, across replicas (0 = no cap);
    past it, 429."""
    ui_insecure_cookies: bool = False
    """Send the UI's cookies without ``Secure``, for a UI served over plain http (``sluicegate
    up`` on 127.0.0.1); else they are ``Secure``, whatever scheme the gateway itself sees."""
    usage_stream: str = "sg:usage"
    usage_flush_interval_s: float = 0.5
    usage_flush_batch: int = 500
    run_usage_flusher: bool = True
    """Run a usage flusher in this gateway process (any number of replicas may)."""
    usage_retention_days: int = 0
    """Delete per-request usage records finished before 00:00 UTC this many days ago, in small
    batches, from every replica that runs a usage flusher; the rollups every report and budget
    reads are kept whole. 0 = keep the records forever."""
    response_retention_days: int = 30
    """Delete stored Responses (``store``, which OpenAI's API defaults to true) created before
    00:00 UTC this many days ago, in small batches, from every replica; OpenAI keeps them 30
    days. 0 = keep them until deleted by ``DELETE /v1/responses/{id}``."""
    max_file_bytes: int = 100 * 1024 * 1024
    """Largest file ``POST /v1/files`` takes (a batch's input JSONL)."""
    batch_file_store: str = "postgres"
    """Where files' bytes live: ``postgres`` (the ``batch_files`` table) or ``s3``."""
    batch_s3_endpoint_url: str = ""
    """The S3-compatible store's URL (AWS: ``https://s3.<region>.amazonaws.com``); its
    credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID``...)."""
    batch_s3_bucket: str = ""
    batch_s3_region: str = "us-east-1"
    run_batch_runner: bool = True
    """Run batch lines in this gateway process (any number of replicas may: lines are claimed
    in PostgreSQL, each runs once)."""
    batch_concurrency: int = 8
    """Batch lines one replica runs at a time."""
    batch_price_multiplier: float = 0.5
    """Batch lines cost this fraction of the live price (OpenAI's batches are half price)."""
    batch_claim_s: float = 30.0
    """A running line's claim lasts this long unless renewed (every third of it); a replica
    that died leaves its lines to others after it."""
    cooldown_failures: int = 3
    cooldown_s: float = 30.0
    upstream_retries: int = 1
    """Retries of one deployment after a 429, 5xx or connect error before the first token,
    before the next deployment is tried."""
    retry_backoff_s: float = 0.05
    """First retry's wait (doubling each time) when the upstream named no retry-after."""
    max_retry_after_s: float = 2.0
    """A longer retry-after moves on to the next deployment instead of waiting."""
    speculative_dispatch: bool = True
    """Send a request of a key far from its limits upstream while its admission is still in
    Redis (``sluicegate.gateway.admission.speculation``); false: always after."""
    busy_poll_us: int = 300
    """While a speculative request waits for its replies on an otherwise idle replica, poll for
    them this long instead of sleeping (``sluicegate.gateway.http.busy_poll``); 0: never."""
    worker_heartbeat_ttl_s: float = 5.0
    resume_timeout_s: float = 30.0
    """How long a stream whose engine worker died waits for another worker to take it over."""
    lease_s: float = 10.0
    """A replica that has not renewed its requests' leases for this long is taken for dead;
    any other replica then settles them (usage, reservation, concurrency slot)."""
    otel_capture_content: bool = False
    """Put prompts and completions into spans; off unless explicitly enabled."""
    currency: str = "USD"
    """The one currency of prices, costs and money budgets (ISO 4217 code)."""
    instance_id: str = field(default_factory=lambda: os.urandom(4).hex())

    def __post_init__(self) -> None:
        object.__setattr__(self, "database_url", asyncpg_database_url(self.database_url))

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        values = {}
        for f in fields(cls):
            if f.name in overrides:
                values[f.name] = overrides[f.name]
            elif f.name != "instance_id":
                default = f.default
                values[f.name] = _env_value(f.name, default)
        settings = cls(**values)
        if "SLUICEGATE_CLIENT_ADDRESS_HEADER" in os.environ and settings.trusted_proxy_count <= 0:
            # Before SLUICEGATE_TRUSTED_PROXY_COUNT, setting the header alone made it read.
            logger.warning(
                "SLUICEGATE_CLIENT_ADDRESS_HEADER is ignored while "
                "SLUICEGATE_TRUSTED_PROXY_COUNT is 0: client addresses are TCP peers"
            )
        return settings
