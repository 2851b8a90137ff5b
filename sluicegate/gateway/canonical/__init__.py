"""The one chat model inside the gateway.

Every inbound API (OpenAI chat and completions today; Anthropic Messages and OpenAI Responses
next) translates its request into a ``ChatRequest`` and renders ``Response`` / ``Chunk`` back
into its own shape; every provider translates a ``ChatRequest`` into its backend's call and its
backend's answer into ``Response`` / ``Chunk``. No inbound API knows a provider and no provider
knows an inbound API, with one deliberate exception: ``ChatRequest.passthrough`` carries the
client's own OpenAI body, so an OpenAI-compatible upstream receives it field for field (and a
``Chunk``/``Response`` may carry the upstream's own JSON in ``raw`` for the way back).

Names follow OpenAI's where both agree (so a ``param`` path such as ``messages[1].content[0]``
means the same thing in the canonical model as in an OpenAI body); message ``i`` and part ``j``
of a canonical request are message ``i`` and content part ``j`` of the inbound request.
"""

from sluicegate.gateway.canonical.answer import (
    Choice,
    ChoiceDelta,
    Chunk,
    FinishReason,
    Response,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    text_message,
)
from sluicegate.gateway.canonical.request import (
    AudioPart,
    ChatRequest,
    FilePart,
    ImagePart,
    Message,
    OutputFormat,
    Part,
    ReasoningEffort,
    ReasoningPiece,
    Role,
    Sampling,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
    ToolResult,
)

__all__ = [
    "AudioPart",
    "ChatRequest",
    "Choice",
    "ChoiceDelta",
    "Chunk",
    "FilePart",
    "FinishReason",
    "ImagePart",
    "Message",
    "OutputFormat",
    "Part",
    "ReasoningEffort",
    "ReasoningPiece",
    "Response",
    "Role",
    "Sampling",
    "TextPart",
    "Thinking",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolResult",
    "TopLogprob",
    "Usage",
    "text_message",
]
