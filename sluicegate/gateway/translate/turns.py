"""What the hosted APIs with alternating turns (Anthropic Messages, Bedrock Converse, Gemini)
share on the way out and back; each keeps its own block shapes.

System and developer turns are set apart (each API has its own place for them); ``tool`` turns
become ``user`` turns; consecutive turns of one role are merged, as these APIs want the roles
to alternate; a turn left with no blocks is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sluicegate.gateway.canonical import Message, Part, ReasoningPiece, Usage


def tool_input(arguments: str) -> Any:
    """A tool call's JSON arguments as the object these APIs take; text that is not JSON is
    kept under ``_raw`` rather than lost."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return {"_raw": arguments}


def with_thinking(
    message: Message,
    block_of: Callable[[Part], dict[str, Any] | None],
    thinking_block: Callable[[ReasoningPiece], dict[str, Any]],
) -> list[dict[str, Any]]:
    """``message``'s blocks (``block_of`` each part, ``None`` to leave one out), and in an
    assistant turn its signed and redacted thinking blocks, each back in its place: Claude
    (Anthropic's API and Bedrock's) wants every one back as issued, and refuses a tool loop
    with thinking on without them. Thinking without a signature (another model's) it cannot
    take, and is left out."""
    pieces: list[ReasoningPiece] = []
    if message.role == "assistant":
        pieces = [p for p in message.reasoning_pieces or () if p.signature or p.redacted]
    blocks: list[dict[str, Any]] = []
    for k, part in enumerate(message.parts):
        while pieces and pieces[0].at <= k:
            blocks.append(thinking_block(pieces.pop(0)))
        block = block_of(part)
        if block is not None:
            blocks.append(block)
    blocks.extend(map(thinking_block, pieces))
    return blocks


def split_turns(
    messages: Iterable[Message],
    blocks_of: Callable[[Message], list[dict[str, Any]]],
    *,
    assistant: str = "assistant",
    key: str = "content",
) -> tuple[list[str], list[dict[str, Any]]]:
    """The system and developer texts, and the other turns as ``{"role", key: blocks}`` with
    ``assistant`` as the assistant's role name (``blocks_of`` is called once per turn, in
    order)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role in {"system", "developer"}:
            system.append(message.text())
            continue
        role = assistant if message.role == "assistant" else "user"
        blocks = blocks_of(message)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1][key].extend(blocks)
        else:
            turns.append({"role": role, key: blocks})
    return system, turns


def usage_with_cache(
    raw: Mapping[str, Any] | None, *, input: str, output: str, read: str, written: str
) -> Usage | None:
    """Usage from an API that counts cache reads and writes apart from its input tokens (the
    field names given); ours include them in ``prompt_tokens``."""
    if not raw:
        return None
    cache_read = int(raw.get(read) or 0)
    cache_written = int(raw.get(written) or 0)
    return Usage(
        prompt_tokens=int(raw.get(input) or 0) + cache_read + cache_written,
        completion_tokens=int(raw.get(output) or 0),
        cached_tokens=cache_read,
        cache_creation_tokens=cache_written,
    )
