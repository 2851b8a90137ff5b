"""A prompt's tokens as a deployment counts them (``/v1/messages/count_tokens``).

Where the backend has a count of its own (our engines, Anthropic's and Gemini's count
endpoints, Bedrock's CountTokens for the models that have it), that is the answer, and nothing
is generated. Elsewhere the prompt is measured by a one-token generation, whose usage holds
the prompt's tokens: a real generation upstream, paid for like any, so it is billed to the key
like any request (``generated``). The probe leaves out what would make a one-token answer
invalid — ``thinking`` and ``reasoning_effort`` (a thinking budget must stay below
``max_tokens``), the output format, ``n`` — none of which changes what the prompt counts.
"""

from __future__ import annotations

import msgspec

from sluicegate.gateway.call.response_builder import collect
from sluicegate.gateway.canonical import ChatRequest, Usage
from sluicegate.gateway.providers.base import Provider


class Counted(msgspec.Struct, frozen=True):
    tokens: int | None
    """None when a probe's upstream reported no usage."""
    generated: bool = False
    """Whether a one-token generation measured the prompt (and is to be billed)."""
    usage: Usage | None = None
    """That generation's usage."""


async def count_on(provider: Provider, request: ChatRequest) -> Counted:
    count = getattr(provider, "count_tokens", None)
    if count is not None:
        tokens: int | None = await count(request)
        if tokens is not None:
            return Counted(tokens)
    sampling = msgspec.structs.replace(request.sampling, max_tokens=1, n=1)
    probe = msgspec.structs.replace(
        request, sampling=sampling, output=None, thinking=None, reasoning_effort=None
    )
    usage = (await collect(provider, probe)).usage
    return Counted(usage.prompt_tokens if usage else None, generated=True, usage=usage)
