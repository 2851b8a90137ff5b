"""Offline API: submit a batch of prompts, run the engine until all finish, return outputs."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.engine_core import EngineCore, EngineOptions, RequestDelta
from engine.protocol import ToolCall
from engine.request_options import RequestOptions
from engine.sampler import TokenLogprobs
from engine.sampling import SamplingParams

Prompt = str | list[int]
Messages = list[Mapping[str, Any]]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens) or "abort"."""
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    reasoning_text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class LLM:
    """A model folder loaded into one engine, for offline batch generation.

    Extra keyword options (``kv_cache_memory``, ``gpu_memory_utilization``, ``max_model_len``,
    ``max_waiting``, ``attention_backend``, ``seed``, ``num_threads``, ``onednn_linears``,
    ``model_impl``) are those of ``engine.engine_core.EngineOptions``; ``model_impl`` is
    "auto" (native code for Llama, Mistral, Qwen2, Qwen3, otherwise the checkpoint's
    transformers class on our paged attention), "native" or "transformers".
    """

    def __init__(
        self,
        model: str | Path,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        device: str = "auto",
        dtype: str = "auto",
        **options: Any,
    ) -> None:
        self.engine = EngineCore(
            model,
            EngineOptions(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                device=device,
                dtype=dtype,
                **options,
            ),
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        options: RequestOptions | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list: list[Prompt] = list(prompts)  # type: ignore[arg-type]
        token_ids = [
            self.engine.prompt_ids(prompt=p)
            if isinstance(p, str)
            else self.engine.prompt_ids(prompt_token_ids=list(p))
            for p in prompt_list
        ]
        texts = [p if isinstance(p, str) else None for p in prompt_list]
        return self._run(texts, token_ids, params, options)

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        options: RequestOptions | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation, via the chat template;
        ``options`` adds tools, structured output or template variables (one choice each)."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        token_ids = [
            self.engine.prompt_ids(messages=list(c), options=options) for c in conversations
        ]
        return self._run([None] * len(token_ids), token_ids, params, options, chat=True)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def _run(
        self,
        texts: list[str | None],
        token_ids: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        options: RequestOptions | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        if options is not None and options.n != 1:
            raise ValueError("n > 1 is served by AsyncEngine; LLM returns one choice per prompt")
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(token_ids)
        else:
            params_list = list(params)
            if len(params_list) != len(token_ids):
                raise ValueError(f"{len(params_list)} SamplingParams for {len(token_ids)} prompts")
        outputs: dict[str, RequestOutput] = {}
        engine = self.engine
        try:
            for text, ids, p in zip(texts, token_ids, params_list, strict=True):
                request_id = f"llm-{next(self._ids)}"
                engine.add_request(request_id, ids, p, options, chat=chat)
                outputs[request_id] = RequestOutput(
                    request_id, text, ids, logprobs=[] if p.logprobs is not None else None
                )
            while engine.has_unfinished():
                for delta in engine.step():
                    _apply(outputs[delta.request_id], delta)
        finally:
            for request_id, output in outputs.items():
                if output.finish_reason is None:
                    engine.abort(request_id)
        return list(outputs.values())


def _apply(output: RequestOutput, delta: RequestDelta) -> None:
    output.token_ids.extend(delta.token_ids)
    output.text += delta.text
    output.reasoning_text += delta.reasoning_text
    for fragment in delta.tool_calls:
        if fragment.id is not None:
            output.tool_calls.append(ToolCall(fragment.id, fragment.name or "", ""))
        output.tool_calls[fragment.index].arguments += fragment.arguments
    if output.logprobs is not None:
        output.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        output.finish_reason = delta.finish_reason
        if delta.usage is not None:
            output.num_cached_tokens = delta.usage.cached_tokens
