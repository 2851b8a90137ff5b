"""The Redis names the gateway and engine workers meet at: streams, channels and keys.

Torch-free, like ``protocol`` (the messages themselves). Every name that travels together
shares the ``{model}`` hash tag, so a Redis Cluster keeps a model's streams on one slot:

- requests:   ``sg:{<model>}:requests``   consumer group ``workers``; field ``m`` = Request
- affinity:   ``sg:{<model>}:w:<worker>``  one worker's own request stream (same group), used when
  the gateway routes a request to the worker that holds its prefix; a dead worker's stream is
  drained by the others
- replies:    ``sg:reply:{<id>}``          a stream per request or per gateway replica (the
  request's ``reply_to``), expires; field ``m`` = Delta | Error | Batch; a gateway reads it
  as the consumer group ``gateway`` (NOACK), whose last-delivered id says how far it read
- started:    ``sg:{<model>}:started:<request_id>``  set before a request's first delta is
  written, so whoever claims a dead worker's request knows whether tokens already went out
- cancels:    ``sg:{<model>}:cancels``    pub/sub channel; payload = Cancel
- heartbeats: ``sg:hb:{<model>}:<worker>`` an expiring key holding the Heartbeat, and the set
  ``sg:{<model>}:workers`` of worker ids that ever announced themselves (pruned when drained)
- prefix map: ``sg:{<model>}:aff:<hash>``  gateway-side prefix hash -> worker id, short TTL
- produced:   ``sg:produced:{<request_id>}``  tokens a request produced so far (see
  ``produced_key``), refreshed about twice a second and when it ends
- control:    ``sg:{<model>}:ctl:<worker>``  commands to one worker (``LoadLora``,
  ``UnloadLora``); each answers a ``ControlReply`` on the command's ``reply_to`` stream
- KV events:  ``sg:{<model>}:kv:<worker>``  what one worker's prefix cache gained and lost, a
  ``KvEventBatch`` per engine step (field ``m``), capped length; ``sg:{<model>}:kvsnap:<worker>``
  its latest ``KvSnapshot``; ``sg:{<model>}:tok:<digest>`` the ``TokenizerFiles`` its heartbeat's
  ``tokenizer_digest`` names (docs/kv-events.md)
"""

from __future__ import annotations

REQUEST_GROUP = "workers"
MESSAGE_FIELD = b"m"


def request_stream(model: str) -> str:
    return f"sg:{{{model}}}:requests"


def cancel_channel(model: str) -> str:
    return f"sg:{{{model}}}:cancels"


def reply_stream(request_id: str) -> str:
    return f"sg:reply:{{{request_id}}}"


def worker_stream(model: str, worker_id: str) -> str:
    return f"sg:{{{model}}}:w:{worker_id}"


def started_key(model: str, request_id: str) -> str:
    return f"sg:{{{model}}}:started:{request_id}"


MAX_RESUMES = 3
"""Resumptions of one request after worker deaths: one that kills every worker it lands on
must stop."""


def attempt_id(request_id: str, attempt: int) -> str:
    """The engine request id of a gateway request's ``attempt``-th resumption (0: the first)."""
    return f"{request_id}.r{attempt}" if attempt else request_id


def produced_key(request_id: str) -> str:
    """What the engine produced for one engine request, kept by the worker for a while so a
    gateway replica can settle the usage of a request whose own replica died: a hash with
    ``p`` (prompt tokens), ``n`` (output tokens, resumed ones included), ``m`` (model) and
    ``d`` (1 once the request ended)."""
    return f"sg:produced:{{{request_id}}}"


def control_stream(model: str, worker_id: str) -> str:
    return f"sg:{{{model}}}:ctl:{worker_id}"


def kv_events_stream(model: str, worker_id: str) -> str:
    return f"sg:{{{model}}}:kv:{worker_id}"


def kv_snapshot_key(model: str, worker_id: str) -> str:
    return f"sg:{{{model}}}:kvsnap:{worker_id}"


def tokenizer_key(model: str, digest: str) -> str:
    return f"sg:{{{model}}}:tok:{digest}"


def worker_registry(model: str) -> str:
    return f"sg:{{{model}}}:workers"


def affinity_key(model: str, prefix_hash: int) -> str:
    return f"sg:{{{model}}}:aff:{prefix_hash:x}"


def heartbeat_key(model: str, worker_id: str) -> str:
    return f"sg:hb:{{{model}}}:{worker_id}"


MODEL_REGISTRY = "sg:models"
"""Sorted set: served model name -> Unix time of its latest worker heartbeat. The gateway
discovers models from it (no SCAN, which a Redis Cluster would need on every node)."""
MODEL_STAMP_KEPT_S = 7 * 86400.0
"""Workers drop models stamped longer ago than this, so names of models long gone do not pile
up (every reader looks back an hour at most)."""
