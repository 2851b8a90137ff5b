"""Gemini refuses a bad key, or a project without billing, with a 400 (its reason in the
error's ``details``), not a 401/403: that is the deployment's fault, not the client's request,
so the router may fall back, and Google's words go to the operator's log only."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sluicegate.gateway.canonical import ChatRequest, text_message
from sluicegate.gateway.providers.base import ProviderError

from .conftest import ProviderFactory
from .fake_gemini import BAD_KEY_MESSAGE


async def _fail(provider: Any, stream: bool) -> ProviderError:
    request = ChatRequest(model="m", messages=[text_message("user", "hi")])
    with pytest.raises(ProviderError) as caught:
        if stream:
            async for _ in provider.generate(request):
                pass
        else:
            await provider.complete(request)
    return caught.value


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("model", "key", "logged"),
    [
        ("plain", "not-a-key", BAD_KEY_MESSAGE),
        ("unbilled", None, "Please enable billing"),
    ],
    ids=["bad-key", "no-billing"],
)
async def test_a_refused_deployment_is_retryable_and_its_reason_is_logged_only(
    make_provider: ProviderFactory,
    caplog: pytest.LogCaptureFixture,
    model: str,
    key: str | None,
    logged: str,
    stream: bool,
) -> None:
    provider = make_provider("gemini", model, **({"api_key": key} if key else {}))
    with caplog.at_level(logging.WARNING, logger="sluicegate.gateway.providers"):
        error = await _fail(provider, stream)
    assert error.retryable, "another deployment may serve the request"
    assert error.status_code == 502 and error.code == "upstream_error"
    assert "refused" in error.message and logged not in error.message
    assert logged in caplog.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_invalid_request_is_still_the_clients(
    make_provider: ProviderFactory, stream: bool
) -> None:
    error = await _fail(make_provider("gemini", "bad"), stream)
    assert not error.retryable and error.status_code == 400 and error.code == "invalid_request"
    assert "invalid argument" in error.message
