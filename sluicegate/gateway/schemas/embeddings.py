"""OpenAI's embeddings request. The body goes to the upstream as sent (only ``model``
rewritten); the gateway reads what it needs to admit and bill it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sluicegate.gateway import canonical
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.schemas.bounds import MAX_EMBEDDING_DIMENSIONS, MAX_EMBEDDING_INPUTS


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | Annotated[list[str | int | list[int]], Meta(max_length=MAX_EMBEDDING_INPUTS)]
    """A string, strings, token ids, or lists of token ids (msgspec allows one list type)."""
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Meta(ge=1, le=MAX_EMBEDDING_DIMENSIONS)] | None = None
    user: str | None = None

    def check(self) -> None:
        if not self.input:
            raise InvalidRequest("input must not be empty.", param="input")
        if isinstance(self.input, list):
            kinds = {type(item) for item in self.input}
            if len(kinds) > 1 or (list in kinds and not all(self.input)):
                raise InvalidRequest(
                    "input must be a string, strings, token ids, or lists of token ids.",
                    param="input",
                )

    def canonical(self, document: dict[str, Any]) -> canonical.ChatRequest:
        """A canonical request whose prompt is the input (for admission's estimate) and whose
        passthrough is the client's body."""
        items: list[Any] = [self.input] if isinstance(self.input, str) else list(self.input)
        if all(isinstance(item, str) for item in items):
            prompt: str | list[int] = "\n".join(items)
        else:
            prompt = [t for item in items for t in (item if isinstance(item, list) else [item])]
        return canonical.ChatRequest(
            model=self.model, prompt=prompt, user=self.user, passthrough=document
        )
