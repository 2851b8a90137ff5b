"""The gateways users would pick instead of ours, for ``gateway_overhead.py --peers``.

Each runs on this machine in its lightest documented mode, in front of the same instant
upstream as ours, and is asked the same request:

- LiteLLM's proxy (``pip install 'litellm[proxy]'`` into its own virtualenv, given by
  ``--litellm``): one model on the upstream, a master key, no database.
- Portkey's open-source gateway (``npm install @portkey-ai/gateway``, ``--portkey`` names its
  ``build/start-server.js``): routing only, the upstream named per request by Portkey's
  ``x-portkey-provider`` / ``x-portkey-custom-host`` headers.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

LITELLM_MASTER_KEY = "sk-litellm-bench-master"

Starter = Callable[..., Any]


def _request(port: int, body: bytes, headers: dict[str, str]) -> bytes:
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n{lines}"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


@contextlib.contextmanager
def litellm(
    binary: str, port: int, upstream_port: int, model: str, body: bytes, process: Starter
) -> Iterator[tuple[Any, bytes, str]]:
    """LiteLLM's proxy: (its process, the request to send it, its readiness URL)."""
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "sk-upstream",
                },
            }
        ],
        "general_settings": {"master_key": LITELLM_MASTER_KEY},
        "litellm_settings": {"telemetry": False},
    }
    path = Path(tempfile.mkdtemp(prefix="sg-litellm-")) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
    env |= {"LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true", "LITELLM_TELEMETRY": "False"}
    args = [binary, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--num_workers", "1"]
    with process(args, env) as proc:
        headers = {"authorization": f"Bearer {LITELLM_MASTER_KEY}"}
        yield proc, _request(port, body, headers), f"http://127.0.0.1:{port}/health/liveliness"


@contextlib.contextmanager
def portkey(
    script: str, port: int, upstream_port: int, model: str, body: bytes, process: Starter
) -> Iterator[tuple[Any, bytes, str]]:
    """Portkey's gateway: (its process, the request to send it, its readiness URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
    env["NODE_ENV"] = "production"
    with process(["node", script, f"--port={port}", "--headless"], env) as proc:
        headers = {
            "x-portkey-provider": "openai",
            "x-portkey-custom-host": f"http://127.0.0.1:{upstream_port}/v1",
            "authorization": "Bearer sk-upstream",
        }
        yield proc, _request(port, body, headers), f"http://127.0.0.1:{port}/"


def verdict(ours: dict[str, Any], portkey_result: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's target: at least 2x Portkey's req/s at no more than half its added latency."""
    if not portkey_result:
        return {}
    rps_ratio = ours["rps"] / portkey_result["rps"] if portkey_result["rps"] else None
    added_ratio = (
        ours["median_added_ms"] / portkey_result["median_added_ms"]
        if portkey_result["median_added_ms"] > 0
        else None
    )
    return {
        "rps_vs_portkey": round(rps_ratio, 2) if rps_ratio else None,
        "added_latency_vs_portkey": round(added_ratio, 2) if added_ratio else None,
        "target_met": bool(rps_ratio and added_ratio and rps_ratio >= 2 and added_ratio <= 0.5),
    }
