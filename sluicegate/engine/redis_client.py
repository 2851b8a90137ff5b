"""Redis clients from one URL, for every topology operators run: the gateway and workers share it.

- ``redis://[user:password@]host:port/db`` and ``rediss://`` (TLS), ``unix://``: one server.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`` (``rediss+sentinel``
  for TLS to the master): the master that the Sentinels name for ``service``, followed through
  failovers. ``?sentinel_password=`` when the Sentinels themselves want one.
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster``): a Redis
  Cluster, found from any of the nodes listed. Every key a command or script touches together
  shares a hash tag (``{model}``, ``{team}``...), so nothing crosses slots.

Subscriptions get ``pubsub_client``: in a cluster a message published on any node reaches
subscribers on every node, so a plain connection to one node is enough there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}

POOL_CHECKS = {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}
"""Options of an asyncio client's pool (single server or Sentinel master), so that it checks
each connection it hands out. redis-py's pool drops a connection the server already closed (at
EOF, seen locally: no round trip) and connects again before a command is written to it; but
with maintenance notifications on (redis-py 8 turns them on, "auto", on every RESP3
connection) its asyncio pool skips that check, so after a Redis restart each connection pooled
before it failed its next command: the gateway's first requests were 503s. (The blocking pool's
check raises at EOF, which it acts on whatever the notifications.) The notifications announce a
managed Redis's planned maintenance (Redis 7 has no such command); without them a moved
endpoint is handled as a restart.

Checking beats retrying: a command that failed on a closed connection may or may not have run
(the admission script is not idempotent: a retry could book a request twice), while one never
written to a closed connection cannot have run. ``health_check_interval`` would PING only the
connections idle longer than it (a round trip for those) and recover from a failed PING only
through the retry policy every command shares, so it is not used either. A peer lost without
closing (no FIN) still fails its command once, after the socket timeout."""


def _cluster_options(options: dict[str, Any], retry: Any) -> dict[str, Any]:
    """A cluster client's options: it sends no command twice. redis-py's cluster client
    resends a command (or a whole pipeline) after a timeout or a broken connection, when it
    may already have run: an admission script booked twice. MOVED and ASK redirects, which
    the node answered without running the command, are still followed; after a failed
    command the client finds the cluster's nodes again before its next one."""
    return {"retry": retry, **options}


@dataclass
class Topology:
    kind: str
    """``single``, ``sentinel`` or ``cluster``."""
    url: str
    nodes: list[tuple[str, int]] = field(default_factory=list)
    service: str = ""
    db: int = 0
    auth: dict[str, Any] = field(default_factory=dict)
    """username/password (and ssl) for the data nodes."""
    sentinel_auth: dict[str, Any] = field(default_factory=dict)


def parse_redis_url(url: str) -> Topology:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SENTINEL_SCHEMES and scheme not in CLUSTER_SCHEMES:
        return Topology("single", url)
    auth: dict[str, Any] = {}
    if parts.username:
        auth["username"] = unquote(parts.username)
    if parts.password:
        auth["password"] = unquote(parts.password)
    if SENTINEL_SCHEMES.get(scheme) or CLUSTER_SCHEMES.get(scheme):
        auth["ssl"] = True
    hosts = parts.netloc.rpartition("@")[2]
    nodes = [_host_port(h) for h in hosts.split(",") if h]
    if not nodes:
        raise ValueError(f"{scheme}:// needs at least one host:port")
    query = parse_qs(parts.query)
    if scheme in CLUSTER_SCHEMES:
        return Topology("cluster", url, nodes, auth=auth)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(f"{scheme}:// needs the service name: {scheme}://host:port/SERVICE")
    sentinel_auth = {}
    if "sentinel_password" in query:
        sentinel_auth["password"] = query["sentinel_password"][0]
    db = int(path[1]) if len(path) > 1 else 0
    return Topology("sentinel", url, nodes, path[0], db, auth, sentinel_auth)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, 26379
    return host.strip("[]"), int(port)


def async_client(url: str, **options: Any) -> aioredis.Redis:
    """The asyncio client for ``url``; ``options`` are connection options (timeouts...)."""
    topology = parse_redis_url(url)
    if topology.kind == "cluster":
        nodes = [AsyncClusterNode(host, port) for host, port in topology.nodes]
        no_resend = AsyncRetry(NoBackoff(), 0)
        cluster: Any = AsyncRedisCluster(
            startup_nodes=nodes, **topology.auth, **_cluster_options(options, no_resend)
        )
        return cluster  # type: ignore[no-any-return]
    if topology.kind == "sentinel":
        sentinel = AsyncSentinel(
            topology.nodes,
            sentinel_kwargs=_sentinel_kwargs(topology, options),
            **{**POOL_CHECKS, **options},
        )
        master: aioredis.Redis = sentinel.master_for(
            topology.service, db=topology.db, **topology.auth
        )
        return master
    return aioredis.from_url(url, **{**POOL_CHECKS, **options})


def sync_client(url: str, **options: Any) -> redis.Redis:
    """The blocking client for ``url`` (threads such as the worker's liveness thread)."""
    topology = parse_redis_url(url)
    if topology.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in topology.nodes]
        no_resend = Retry(NoBackoff(), 0)
        cluster: Any = RedisCluster(
            startup_nodes=nodes, **topology.auth, **_cluster_options(options, no_resend)
        )
        return cluster  # type: ignore[no-any-return]
    if topology.kind == "sentinel":
        sentinel = Sentinel(
            topology.nodes, sentinel_kwargs=_sentinel_kwargs(topology, options), **options
        )
        master: redis.Redis = sentinel.master_for(topology.service, db=topology.db, **topology.auth)
        return master
    return redis.Redis.from_url(url, **options)


def pubsub_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client to SUBSCRIBE with (a plain connection to one node of a cluster)."""
    topology = parse_redis_url(url)
    if topology.kind == "cluster":
        host, port = topology.nodes[0]
        return aioredis.Redis(host=host, port=port, **topology.auth, **options)
    return async_client(url, **options)


def _sentinel_kwargs(topology: Topology, options: dict[str, Any]) -> dict[str, Any]:
    timeouts = {k: v for k, v in options.items() if k.startswith("socket_")}
    return {**timeouts, **topology.sentinel_auth}
