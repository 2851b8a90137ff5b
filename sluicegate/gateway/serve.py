"""``sluicegate gateway --host --port``: serve the gateway with uvicorn.

Settings come from the environment (``SLUICEGATE_*``). uvicorn picks uvloop when installed;
HTTP is parsed by httptools (a dependency), through a protocol that sends each response's head
with its body (``sluicegate.gateway.http.protocol``).

Every open stream holds two sockets, the client's and the upstream's, so the process raises its
own open-file limit to the most it may (the soft limit is often 1,024 under a hard limit of
hundreds of thousands); and it listens with a backlog deep enough for thousands of streams
opened at once (uvicorn's 2,048 overflowed under 10,000: SYNs dropped, clients waiting seconds
to retry). The kernel caps the backlog at ``net.core.somaxconn``.
"""

from __future__ import annotations

import argparse
import logging
import resource

import uvicorn

from sluicegate.gateway.http.protocol import CoalescingHttpToolsProtocol

logger = logging.getLogger(__name__)

BACKLOG = 16384


def raise_open_file_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` raised to the hard limit; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return soft


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sluicegate gateway",
        description="Serve the OpenAI-compatible gateway (settings from SLUICEGATE_* variables).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="processes (default: 1)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight streams may run on after SIGTERM (keep below the pod's grace period)",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=BACKLOG,
        help=f"connections waiting to be accepted (default: {BACKLOG}; capped by the kernel's "
        "net.core.somaxconn)",
    )
    args = parser.parse_args(argv)
    files = raise_open_file_limit()
    if files < 65536:
        # Each stream holds a client and an upstream socket: this caps one process's streams.
        logger.warning("open-file limit %d: at most ~%d streams at once", files, files // 2 - 50)
    uvicorn.run(
        "sluicegate.gateway.app:create_served_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        http=CoalescingHttpToolsProtocol,
        # The gateway reads the client's address itself, and only where a throttle needs it
        # (SLUICEGATE_TRUSTED_PROXY_COUNT): uvicorn parsing X-Forwarded-* on every request is waste.
        proxy_headers=False,
        # Nor does it name its server: a header less to check and send on every response.
        server_header=False,
        timeout_graceful_shutdown=args.graceful_timeout,
        backlog=args.backlog,
    )
    return 0
