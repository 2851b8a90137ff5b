"""Count-only requests (``Request.count_only``): the prompt's tokens, never a generation.

Anthropic's ``/v1/messages/count_tokens`` asks how long a prompt is; the answer must be the
length the model would read (its own chat template, the tools rendered into it), so the
worker renders and tokenizes it as for a generation, and answers at once: nothing is
scheduled, no KV cache is taken, no token is generated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from sluicegate.engine import protocol
from sluicegate.engine.serving.request_options import RequestOptions

if TYPE_CHECKING:
    from sluicegate.engine.serving.async_engine import AsyncEngine


async def count_reply(
    engine: AsyncEngine, request: protocol.Request, worker_id: str
) -> protocol.Delta:
    """The one, final delta answering a count-only ``request``; a prompt the engine cannot
    render raises ``ValueError`` (the worker's invalid request)."""
    options = RequestOptions(
        tools=request.tools,
        tool_choice=request.tool_choice,
        tool_choice_name=request.tool_choice_name,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    inputs: dict[str, Any] = {"options": options}
    if request.messages is not None:
        inputs["messages"] = msgspec.to_builtins(request.messages)
    elif request.prompt_token_ids is not None:
        inputs["prompt_token_ids"] = request.prompt_token_ids
    elif request.prompt is not None:
        inputs["prompt"] = request.prompt
    else:
        raise ValueError("request has no prompt, prompt_token_ids or messages")
    count = await engine.count_prompt_tokens(**inputs)
    return protocol.Delta(
        request_id=request.request_id,
        seq=0,
        finish_reason="stop",
        usage=protocol.Usage(prompt_tokens=count, completion_tokens=0),
        worker_id=worker_id,
    )
