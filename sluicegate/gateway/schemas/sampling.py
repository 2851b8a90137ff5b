"""Request fields chat and text completions share: OpenAI's sampling fields, vLLM's extras."""

from __future__ import annotations

from typing import Any

import msgspec

from sluicegate.gateway import canonical
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.schemas.bounds import (
    Grammar,
    GuidedChoice,
    LogitBias,
    MaxTokens,
    MinP,
    N,
    OpenAITemperature,
    Penalty,
    RepetitionPenalty,
    SamplerTopK,
    SamplerTopP,
    Seed,
    Stop,
    StopTokenIds,
)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class GenerationFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions, OpenAI's plus vLLM's extras."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: OpenAITemperature | None = None
    top_p: SamplerTopP | None = None
    n: N | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: SamplerTopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    guided_json: dict[str, Any] | Grammar | None = None
    guided_choice: GuidedChoice | None = None
    guided_regex: Grammar | None = None
    guided_grammar: Grammar | None = None

    def check(self) -> None:
        if self.top_k is not None and self.top_k == 0:
            raise InvalidRequest("top_k must be -1 (disabled) or at least 1.", param="top_k")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        guided = [
            name
            for name in ("guided_json", "guided_choice", "guided_regex", "guided_grammar")
            if getattr(self, name) is not None
        ]
        if len(guided) > 1:
            raise InvalidRequest(f"Only one of {', '.join(guided)} may be set.", param=guided[1])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logit_bias_by_token(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            bad = next(t for t in self.logit_bias if not t.lstrip("-").isdigit())
            raise InvalidRequest(
                f"logit_bias keys must be token ids (integers as strings); got {bad!r}.",
                param="logit_bias",
            ) from None

    def canonical_sampling(self) -> canonical.Sampling:
        return canonical.Sampling(
            max_tokens=self.requested_max_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            n=self.n or 1,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias_by_token(),
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or None,
        )

    def guided_output(self) -> canonical.OutputFormat | None:
        """vLLM's ``guided_*`` extras as an output constraint."""
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = msgspec.json.decode(schema)
                except msgspec.DecodeError:
                    raise InvalidRequest(
                        "guided_json must be a JSON Schema.", param="guided_json"
                    ) from None
            if not isinstance(schema, dict):
                raise InvalidRequest("guided_json must be a JSON Schema.", param="guided_json")
            return canonical.OutputFormat("json_schema", schema=schema)
        if self.guided_choice is not None:
            return canonical.OutputFormat("choice", choices=self.guided_choice)
        if self.guided_regex is not None:
            return canonical.OutputFormat("regex", regex=self.guided_regex)
        if self.guided_grammar is not None:
            return canonical.OutputFormat("grammar", grammar=self.guided_grammar)
        return None
