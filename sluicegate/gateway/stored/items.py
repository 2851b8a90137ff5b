"""The items of a stored response: what the model read, as OpenAI's ``input_items`` lists them.

A request's input is kept as items each with an ``id`` (a string ``input`` becomes one user
message); a response that continues another (``previous_response_id``) reads that one's items,
then its output, then its own input. Only items the canonical translation takes back are kept
(``sluicegate.gateway.translate.responses_in``), so a rebuilt conversation translates as the
client's own would have.
"""

from __future__ import annotations

import secrets
from typing import Any

from sluicegate.gateway.errors import InvalidRequest

_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
MAX_PAGE = 100
DEFAULT_PAGE = 20


def _new_id(kind: str) -> str:
    return f"{_PREFIXES.get(kind, 'rs')}_{secrets.token_hex(16)}"


def _part(role: str, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def input_items(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as items with ids and typed content, as OpenAI lists them back."""
    if isinstance(input, str):
        input = [{"role": "user", "content": input}]
    out = []
    for raw in input:
        item = {"type": "message", **raw}
        item.setdefault("id", _new_id(item["type"]))
        if item["type"] == "message":
            if isinstance(item["content"], str):
                item["content"] = [_part(item["role"], item["content"])]
            item.setdefault("status", "completed")
        out.append(item)
    return out


def _said(item: dict[str, Any]) -> bool:
    """Whether an output item carries something to read back: an answer that is only empty text
    would be an empty assistant turn, which some backends refuse."""
    if item["type"] != "message":
        return True
    return any(part.get("text") or part.get("refusal") for part in item["content"])


def continued(items: list[dict[str, Any]], response: dict[str, Any]) -> list[dict[str, Any]]:
    """The items a response continuing ``response`` starts from: its items, then its output.

    Reasoning that led to no answer (the output ran out mid-thought) is left out: reasoning
    reads back only as part of the assistant turn after it, and there is none."""
    output = [item for item in response.get("output") or () if _said(item)]
    while output and output[-1]["type"] == "reasoning":
        output.pop()
    return [*items, *output]


def page(
    items: list[dict[str, Any]], *, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """OpenAI's list object over ``items``: ``limit`` of them in ``order``, after the item whose
    id is ``after``."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequest(
                f"No input item with id '{after}' in this response.", param="after"
            )
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


def refuse_unsupported(query: dict[str, str], supported: frozenset[str]) -> None:
    """A query parameter we do not honour (OpenAI's ``include``, ``before``, ``stream``,
    ``starting_after``...) is a 400 naming it, never silently dropped."""
    for name in sorted(query.keys() - supported):
        raise InvalidRequest(f"Query parameter '{name}' is not supported here.", param=name)


PAGE_PARAMS = frozenset({"limit", "order", "after"})


def page_options(query: dict[str, str]) -> tuple[int, str, str | None]:
    """``limit``, ``order`` and ``after`` of an ``input_items`` request; a bad one, or any other
    parameter, is a 400."""
    refuse_unsupported(query, PAGE_PARAMS)
    raw_limit = query.get("limit", str(DEFAULT_PAGE))
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {MAX_PAGE}.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
    return limit, order, query.get("after")
