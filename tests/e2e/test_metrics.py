"""After known traffic, the gateway's and a worker's ``/metrics`` moved by exactly that much."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)

# Long enough (with the chat template) to fill a 16-token block, so a repeat hits the cache.
PROMPT = "Tell me about the gate that holds the water of the river back in the dry season."
BLOCK_SIZE = 16


class Scrape:
    """One ``/metrics`` exposition, read by sample name and labels."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        response = httpx.get(url, headers=headers, timeout=5)
        assert response.status_code == 200, response.text
        text = response.text
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        """The sample's value; 0 for a labelled series not created yet."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def served(cluster: Any, gateway: Any, redis_url: str, tools: SimpleNamespace) -> SimpleNamespace:
    name = tools.model_name("e2e-metrics")
    worker = cluster.worker(name, redis_url)
    gateway.wait_model(name)
    return SimpleNamespace(
        model=name,
        gateway=gateway,
        gateway_metrics=f"{gateway.base_url}/metrics",
        admin_headers=tools.admin_headers,
        worker_metrics=f"http://127.0.0.1:{worker.port}/metrics",
    )


def _greedy(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_gateway_and_worker_counters_move_by_the_traffic(
    served: SimpleNamespace, tiny_model_dir: Path, tools: SimpleNamespace
) -> None:
    from sluicegate.engine.text.tokenizer import Tokenizer

    messages = [{"role": "user", "content": PROMPT}]
    prompt_tokens = len(Tokenizer(tiny_model_dir).apply_chat_template(messages))
    assert prompt_tokens > BLOCK_SIZE
    gateway_before = Scrape(served.gateway_metrics, served.admin_headers)
    worker_before = Scrape(served.worker_metrics)

    client = served.gateway.openai(max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=served.model, messages=messages, **_greedy(6))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 6)
    chunks = list(
        client.chat.completions.create(
            model=served.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **_greedy(4),
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        prompt_tokens,
        4,
    )

    model = {"model": served.model}
    # A stream's metrics are counted as it settles, just after its last byte.
    tools.wait_until(
        lambda: (
            Scrape(served.gateway_metrics, served.admin_headers)(
                "sluicegate_requests_total", **model, status="ok"
            )
            == 2
        ),
        5,
        "the streamed request to be counted",
    )
    gateway = Scrape(served.gateway_metrics, served.admin_headers)
    assert gateway("sluicegate_requests_total", **model, status="ok") == 2
    assert gateway("sluicegate_requests_total", **model, status="error") == 0
    assert gateway("sluicegate_tokens_total", **model, kind="prompt") == 2 * prompt_tokens
    assert gateway("sluicegate_tokens_total", **model, kind="completion") == 6 + 4
    assert gateway("sluicegate_time_to_first_token_seconds_count", **model) == 2
    assert gateway("sluicegate_time_to_first_token_seconds_sum", **model) > 0
    added = "sluicegate_added_latency_seconds_count"
    assert gateway(added) - gateway_before(added) == 2
    assert gateway("sluicegate_usage_flush_lag_seconds") >= 0

    worker = Scrape(served.worker_metrics)
    labels = {"model_name": served.model}

    def moved(name: str) -> float:
        return worker(name, **labels) - worker_before(name, **labels)

    assert moved("sluicegate:prompt_tokens_total") == 2 * prompt_tokens
    assert moved("sluicegate:generation_tokens_total") == 6 + 4
    assert moved("sluicegate:time_to_first_token_seconds_count") == 2
    assert moved("sluicegate:e2e_request_latency_seconds_count") == 2
    # One token per step and request: every token after the first is one inter-token gap.
    assert moved("sluicegate:inter_token_latency_seconds_count") == (6 - 1) + (4 - 1)
    assert moved("sluicegate:num_preemptions_total") == 0
    # Both requests were looked up in the prefix cache; the repeat found the first one's
    # full blocks (all but the block holding its last token, which must be computed).
    assert moved("sluicegate:prefix_cache_queries_total") == 2 * prompt_tokens
    cached = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert moved("sluicegate:prefix_cache_hits_total") == cached
    assert worker("sluicegate:num_requests_running", **labels) == 0
    assert worker("sluicegate:num_requests_waiting", **labels) == 0
    assert worker("sluicegate:kv_cache_usage_perc", **labels) == 0


def test_rate_limited_request_counts_one_rejection(
    served: SimpleNamespace, tools: SimpleNamespace
) -> None:
    key, _ = tools.create_key(served.gateway.base_url, "e2e-metrics-rpm", rpm_limit=1)
    client = openai.OpenAI(
        base_url=f"{served.gateway.base_url}/v1", api_key=key, max_retries=0, timeout=60
    )
    messages = [{"role": "user", "content": "hi"}]
    before = Scrape(served.gateway_metrics, served.admin_headers)
    client.chat.completions.create(model=served.model, messages=messages, **_greedy(2))
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=served.model, messages=messages, **_greedy(2))
    after = Scrape(served.gateway_metrics, served.admin_headers)
    rejected = "sluicegate_rejections_total"
    assert (
        after(rejected, reason="rate_limit_requests")
        - before(rejected, reason="rate_limit_requests")
        == 1
    )
    for reason in ("rate_limit_tokens", "concurrency", "quota"):
        assert after(rejected, reason=reason) == before(rejected, reason=reason)
    requests = "sluicegate_requests_total"
    model = {"model": served.model}
    assert after(requests, **model, status="ok") - before(requests, **model, status="ok") == 1
    assert after(requests, **model, status="error") == before(requests, **model, status="error")
