"""Every bound on what a request may carry, in one place: the request schemas' ``Meta``.

A value outside its bound is refused by the decoder, a 400 whose ``param`` names the field
(``wire.decode_body``), before admission books anything. Where OpenAI or Anthropic document a
limit for a field, the bound is theirs (each note says whose); where neither publishes one,
the bound is ours, marked *ours*, sized well above what a real client sends and well below
what would let one request cost the gateway more than its 4 MiB body already allows.

Token counts matter most: admission reserves ``prompt + max_tokens * n`` against a key's
limits, so a count below 1 would book a negative reservation (a budget credit) and a huge
one would overflow the counters' arithmetic. ``MaxTokens`` keeps every client-sent output
cap in ``[1, MAX_OUTPUT_TOKENS]`` (admission also refuses one beyond every deployment's
declared ``context_window``), and ``MAX_USAGE_TOKENS`` clamps what an upstream reports.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

# ---- token counts ----------------------------------------------------------------------------

MAX_OUTPUT_TOKENS = 1_048_576
"""*Ours*: the largest output cap a client may ask for (``max_tokens``,
``max_completion_tokens``, ``max_output_tokens``): 2**20, above any served model's context.
Both APIs document a lower bound of 1 (Anthropic: ``x >= 1``)."""
MaxTokens = Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)]

MIN_THINKING_BUDGET = 1024
"""Anthropic's: ``thinking.budget_tokens`` is at least 1024."""
ThinkingBudget = Annotated[int, Meta(ge=MIN_THINKING_BUDGET, le=MAX_OUTPUT_TOKENS)]

MAX_USAGE_TOKENS = 2**48
"""*Ours*: the most tokens one upstream-reported count may carry into the counters (they are
clamped into ``[0, MAX_USAGE_TOKENS]``, ``canonical.Usage``); exact in Lua's doubles."""

# ---- sampling --------------------------------------------------------------------------------

MAX_N = 128
"""OpenAI's: ``n`` is 1..128."""
N = Annotated[int, Meta(ge=1, le=MAX_N)]
OpenAITemperature = Annotated[float, Meta(ge=0.0, le=2.0)]
"""OpenAI's: 0..2."""
AnthropicTemperature = Annotated[float, Meta(ge=0.0, le=1.0)]
"""Anthropic's: 0..1."""
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
"""OpenAI's and Anthropic's: 0..1 (Responses, Messages)."""
SamplerTopP = Annotated[float, Meta(gt=0.0, le=1.0)]
"""Chat and text completions: (0, 1], as vLLM takes it (0 would keep no token)."""
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
"""OpenAI's: ``presence_penalty`` and ``frequency_penalty`` are -2..2."""
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
"""vLLM's: 0..1."""
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
"""vLLM's lower bound (> 0); the upper one is *ours*."""
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
"""OpenAI's seed is a 64-bit integer."""

MAX_TOP_K = 1_048_576
"""*Ours*: above any vocabulary."""
SamplerTopK = Annotated[int, Meta(ge=-1, le=MAX_TOP_K)]
"""vLLM's: -1 (disabled) or at least 1 (0 is refused by the schema's ``check``)."""
AnthropicTopK = Annotated[int, Meta(ge=0, le=MAX_TOP_K)]
"""Anthropic's: ``x >= 0`` (0 restricts nothing)."""

MAX_TOP_LOGPROBS = 20
"""OpenAI's: ``top_logprobs`` (and legacy ``logprobs``) is 0..20."""
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]

MAX_LOGIT_BIAS = 300
"""OpenAI's: at most 300 biased tokens, each bias -100..100."""
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)]

MAX_STOP = 4
"""OpenAI's: up to 4 stop sequences."""
MAX_STOP_SEQUENCES = 16
"""*Ours*: Anthropic's ``stop_sequences`` (Anthropic publishes no count)."""
MAX_STOP_CHARS = 1024
"""*Ours*: the length of one stop sequence."""
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)]
StopSequences = Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)]

MAX_STOP_TOKEN_IDS = 256
"""*Ours*: vLLM's ``stop_token_ids``."""
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]

# ---- structured output -----------------------------------------------------------------------

MAX_GRAMMAR_CHARS = 65_536
"""*Ours*: a ``guided_regex``, ``guided_grammar`` or ``guided_json`` (as text), in characters:
each is compiled before the first token, so its size is compile time."""
Grammar = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]
MAX_GUIDED_CHOICES = 1024
"""*Ours*: the choices of ``guided_choice``."""
GuidedChoice = Annotated[
    list[Annotated[str, Meta(max_length=MAX_STOP_CHARS)]],
    Meta(min_length=1, max_length=MAX_GUIDED_CHOICES),
]

# ---- metadata --------------------------------------------------------------------------------

MAX_METADATA_PAIRS = 16
"""OpenAI's: up to 16 key-value pairs, keys of at most 64 characters, values of at most 512."""
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
Metadata = Annotated[
    dict[
        Annotated[str, Meta(max_length=MAX_METADATA_KEY)],
        Annotated[str, Meta(max_length=MAX_METADATA_VALUE)],
    ],
    Meta(max_length=MAX_METADATA_PAIRS),
]
MAX_USER_ID = 256
"""Anthropic's: ``metadata.user_id`` is at most 256 characters."""
UserId = Annotated[str, Meta(max_length=MAX_USER_ID)]

# ---- conversations ---------------------------------------------------------------------------

MAX_MESSAGES = 2048
"""OpenAI's: chat ``messages`` holds at most 2048 (the API refuses more)."""
MAX_ANTHROPIC_MESSAGES = 100_000
"""Anthropic's: at most 100,000 messages in one request."""
MAX_INPUT_ITEMS = 10_000
"""*Ours*: the items of a Responses ``input`` (OpenAI publishes no count; a long agent session
holds two per tool call)."""
MAX_CONTENT_PARTS = 1024
"""*Ours*: content parts (blocks) of one message, tool result or system prompt, and tool calls
of one assistant message."""
MAX_TOOLS = 128
"""OpenAI's: at most 128 functions in ``tools``; the same bound (*ours*) for Anthropic's."""
MAX_INCLUDE = 16
"""*Ours*: the entries of Responses' ``include``."""
MAX_EMBEDDING_INPUTS = 2048
"""OpenAI's: an embeddings ``input`` array holds at most 2048 entries."""
MAX_EMBEDDING_DIMENSIONS = 65_536
"""*Ours*: an embedding's ``dimensions`` (OpenAI's largest model has 3072)."""

# ---- the admin UI ----------------------------------------------------------------------------

MAX_PAGE = 1_000_000
"""*Ours*: the highest page number a listing's ``?page=`` may ask for (its offset must fit
the database's integers)."""
