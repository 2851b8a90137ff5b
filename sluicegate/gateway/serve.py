"""``sluicegate gateway --host --port``: serve the gateway with uvicorn.

Settings come from the environment (``SLUICEGATE_*``). uvicorn picks uvloop when installed;
HTTP is parsed by httptools (a dependency), through a protocol that sends each response's head
with its body (``sluicegate.gateway.http.protocol``).
"""

from __future__ import annotations

import argparse

import uvicorn

from sluicegate.gateway.http.protocol import CoalescingHttpToolsProtocol


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
    args = parser.parse_args(argv)
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
    )
    return 0
