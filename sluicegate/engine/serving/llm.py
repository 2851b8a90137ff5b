"""Offline API: submit a batch of prompts, run the engine until all finish, return outputs."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluicegate.engine.options import EngineOptions
from sluicegate.engine.protocol import ToolCall
from sluicegate.engine.sample.output import TokenLogprobs
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving.async_engine import AsyncEngine
from sluicegate.engine.serving.core import EngineCore
from sluicegate.engine.serving.request_delta import RequestDelta
from sluicegate.engine.serving.request_options import RequestOptions

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
    ``max_waiting``, ``attention_backend``, ``seed``, ``num_threads``, ``cpu_linears``,
    ``model_impl``, ``tensor_parallel_size``, ``speculative_config``) are those of ``sluicegate.engine.options.EngineOptions``; ``model_impl`` is
    "auto" (native code for Llama, Mistral, Qwen2, Qwen3, otherwise the checkpoint's
    transformers class on our paged attention), "native" or "transformers".

    ``core_process=True`` runs the engine core in a process of its own (as the worker's
    ``--core-process``): tokenizing and assembling outputs here overlap its steps. There is
    no ``engine`` attribute then; the core lives in the other process (``close()`` ends it).
    """

    engine: EngineCore

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
        core_process: bool = False,
        **options: Any,
    ) -> None:
        engine_options = EngineOptions(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            device=device,
            dtype=dtype,
            **options,
        )
        self._process: _CoreProcess | None = None
        if core_process:
            self._process = _CoreProcess(model, engine_options)
            assert self._process.engine.tokenizer is not None
            self.tokenizer = self._process.engine.tokenizer
        else:
            self.engine = EngineCore(model, engine_options)
            self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine core process (with ``core_process``), or the in-process engine's
        other tensor-parallel ranks."""
        if self._process is not None:
            self._process.close()
            self._process = None
        else:
            self.engine.close()

    def _prompt_ids(self, **inputs: Any) -> list[int]:
        if self._process is not None:
            return self._process.engine.prompt_ids(**inputs)
        return self.engine.prompt_ids(**inputs)

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
            self._prompt_ids(prompt=p)
            if isinstance(p, str)
            else self._prompt_ids(prompt_token_ids=list(p))
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
        token_ids = [self._prompt_ids(messages=list(c), options=options) for c in conversations]
        return self._run([None] * len(token_ids), token_ids, params, options, chat=True)

    def stats(self) -> dict[str, Any]:
        if self._process is not None:
            return self._process.engine.stats()
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
        requests = []
        for text, ids, p in zip(texts, token_ids, params_list, strict=True):
            request_id = f"llm-{next(self._ids)}"
            requests.append((request_id, ids, p))
            outputs[request_id] = RequestOutput(
                request_id, text, ids, logprobs=[] if p.logprobs is not None else None
            )
        if self._process is not None:
            self._process.run(requests, options or RequestOptions(), chat, outputs)
            return list(outputs.values())
        engine = self.engine
        try:
            for request_id, ids, p in requests:
                engine.add_request(request_id, ids, p, options, chat=chat)
            while engine.has_unfinished():
                for delta in engine.step():
                    _apply(outputs[delta.request_id], delta)
        finally:
            for request_id, output in outputs.items():
                if output.finish_reason is None:
                    engine.abort(request_id)
        return list(outputs.values())


class _CoreProcess:
    """An ``AsyncEngine`` with its core in another process, driven from synchronous code."""

    def __init__(self, model: str | Path, options: EngineOptions) -> None:
        self.runner = asyncio.Runner()
        self.engine = AsyncEngine(model, options, core_process=True)
        self.runner.run(self.engine.start())

    def run(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        options: RequestOptions,
        chat: bool,
        outputs: dict[str, RequestOutput],
    ) -> None:
        self.runner.run(self._run(requests, options, chat, outputs))

    async def _run(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        options: RequestOptions,
        chat: bool,
        outputs: dict[str, RequestOutput],
    ) -> None:
        engine = self.engine
        client = engine._client
        assert client is not None

        async def one(request_id: str, ids: list[int], params: SamplingParams) -> None:
            async for delta in engine._submit(client, request_id, ids, params, options, chat):
                _apply(outputs[request_id], delta)

        tasks = [asyncio.ensure_future(one(*request)) for request in requests]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # As in-process: one request that cannot run fails the call, and the rest stop.
            for request_id in outputs:
                engine.abort(request_id)
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def close(self) -> None:
        self.runner.run(self.engine.shutdown())
        self.runner.close()


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
