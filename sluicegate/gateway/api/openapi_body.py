"""Request bodies in the OpenAPI document for handlers that decode the raw body themselves.

The generation endpoints read ``await request.body()`` and decode it with msgspec in one pass
(``decode_body``: our own 400s, naming the field), so their handlers take no ``data``
parameter and Litestar would document no request body. ``body_operation(T)`` is an
``operation_class`` that declares the JSON Schema of ``T``, the very type the handler decodes
into, as the operation's required JSON body: the document cannot drift from what is accepted,
and how the body is parsed does not change.

The schema is inlined (its ``$defs`` resolved in place): an operation cannot add entries to
the document's ``components``, and a ``#/$defs/...`` reference would resolve against the
OpenAPI document's root, not the schema's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPIMediaType, Operation, RequestBody

_DEFS = "#/$defs/"


def inline_schema(model: type) -> dict[str, Any]:
    """``model``'s JSON Schema (msgspec's) with every ``$ref`` replaced by its definition."""
    schema = msgspec.json.schema(model)
    defs: dict[str, Any] = schema.pop("$defs", {})

    def resolve(node: Any, within: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(item, within) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS):
            name = ref[len(_DEFS) :]
            if name in within:
                raise ValueError(f"{model.__name__}: {name} is recursive; it cannot be inlined")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**resolve(defs[name], (*within, name)), **resolve(rest, within)}
        return {key: resolve(value, within) for key, value in node.items()}

    resolved: dict[str, Any] = resolve(schema, ())
    return resolved


def body_operation(model: type, description: str | None = None) -> type[Operation]:
    """An ``operation_class`` whose operation takes ``model`` as its JSON request body."""
    body = RequestBody(
        content={"application/json": OpenAPIMediaType(schema=inline_schema(model))},  # type: ignore[arg-type]
        description=description,
        required=True,
    )

    @dataclass
    class WithBody(Operation):
        def __post_init__(self) -> None:
            self.request_body = body

    WithBody.__name__ = WithBody.__qualname__ = f"{model.__name__}Operation"
    return WithBody
