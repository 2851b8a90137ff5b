"""The step loop shared by ``LLM`` and ``AsyncEngine``: schedule -> forward -> sample ->
postprocess -> detokenize and stop strings. Single-threaded: callers serialise access."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import SchedulerConfig
from engine.model_runner import ModelRunner
from engine.models import load_model
from engine.models.onednn import can_use_onednn, use_onednn_linears
from engine.protocol import Usage
from engine.sampler import Sampler, TokenLogprobs
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EngineOptions:
    """How one engine is built. KV cache size: ``num_kv_blocks`` if given; else on CUDA
    ``gpu_memory_utilization`` x total memory less weights and peak activations; else on CPU
    ``kv_cache_memory`` bytes (default 1 GiB). ``max_model_len`` defaults to the model's
    ``max_position_embeddings``; ``attention_backend`` is "triton" or "torch" (default by
    device, or ``SLUICEGATE_ATTENTION_BACKEND``); ``seed`` seeds unseeded sampling."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_waiting: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str | None = None
    seed: int | None = None
    # CPU only: torch intra-op threads for the process; None keeps torch's default (every
    # core). On a machine shared with other busy processes, 1 can be far faster: each op
    # splits its work evenly, so a thread that is not scheduled stalls the whole op.
    num_threads: int | None = None
    # CPU float32 only: run the linears through oneDNN (see engine.models.onednn).
    onednn_linears: bool = True
    # "native" (our own Llama/Mistral/Qwen2/Qwen3 code), "transformers" (the checkpoint's
    # transformers class on our paged attention), or "auto": native where there is one.
    model_impl: str = "auto"


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """A request's phases in ``time.monotonic()`` seconds; None for a phase never reached."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float
    num_preemptions: int


@dataclass
class RequestDelta:
    """What one step added to one request. The last delta has ``finish_reason``, ``usage``
    and ``timings``; every delta names the prompt's length, so a request cut short (client
    gone, worker draining) is billed its real prompt tokens rather than an estimate."""

    request_id: str
    num_prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    delivered_tokens: int = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    def __init__(self, model: str | Path, options: EngineOptions | None = None) -> None:
        options = options or EngineOptions()
        self.options = options
        self.device = resolve_device(options.device)
        if self.device.type == "cpu" and options.num_threads:
            torch.set_num_threads(options.num_threads)
        self.tokenizer = Tokenizer(model)
        self.model = load_model(model, self.device, options.dtype, options.model_impl)
        if options.onednn_linears and can_use_onednn(self.model):
            use_onednn_linears(self.model)
        config = self.model.config
        max_model_len = options.max_model_len or config.max_position_embeddings
        if config.sliding_window and max_model_len > config.sliding_window:
            logger.warning(
                "context length capped at the model's sliding window of %d tokens",
                config.sliding_window,
            )
            max_model_len = config.sliding_window
        self.runner = ModelRunner(
            self.model,
            self.device,
            block_size=options.block_size,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=max_model_len,
            num_kv_blocks=options.num_kv_blocks,
            kv_cache_memory=options.kv_cache_memory,
            gpu_memory_utilization=options.gpu_memory_utilization,
            attention_backend=options.attention_backend,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_kv_blocks=self.runner.num_kv_blocks,
                max_model_len=max_model_len,
                block_size=options.block_size,
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                enable_prefix_caching=options.enable_prefix_caching,
                max_waiting=options.max_waiting,
            )
        )
        self.sampler = Sampler(self.device, options.seed)
        self.eos_token_ids = self.tokenizer.eos_token_ids | set(config.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self.num_generated_tokens = 0
        self.started_at = time.monotonic()

    # -- requests ---------------------------------------------------------------------------

    def prompt_ids(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
        if prompt is not None:
            return self.tokenizer.encode(prompt)
        if messages is not None:
            return self.tokenizer.apply_chat_template(messages, **(chat_template_kwargs or {}))
        assert prompt_token_ids is not None
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return list(prompt_token_ids)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        resume_token_ids: list[int] | None = None,
        resume_text_chars: int = 0,
    ) -> Sequence:
        """Queue a request; raises ``RequestRejected`` if it can never run here.

        A resumed request continues after ``resume_token_ids`` (outputs an earlier attempt
        streamed, of which the client was shown the first ``resume_text_chars`` characters of
        text): it goes on exactly as the uninterrupted request would, and its deltas carry only
        what comes after."""
        vocab = self.model.config.vocab_size
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        resumed = list(resume_token_ids or [])
        if any(not 0 <= t < vocab for t in resumed):
            raise ValueError(f"resume token ids must be in [0, {vocab})")
        seq = Sequence(
            request_id, prompt_token_ids, params, self.eos_token_ids, output_token_ids=resumed
        )
        self.scheduler.add(seq)
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop)
        if resumed:
            detokenizer.replay(resumed, resume_text_chars)
        self._requests[request_id] = _Request(seq, detokenizer, delivered_tokens=len(resumed))
        return seq

    def abort(self, request_id: str) -> RequestDelta | None:
        """Free the request's blocks now; its final delta, or None if it is not in flight."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort(request_id)
        return self._final_delta(request, RequestDelta(request_id), "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        logits = self.runner.run(output)
        sampling_items = [item for item in output.scheduled if item.samples]
        sampled = self.sampler(logits, [item.seq for item in sampling_items])
        next_token = iter(sampled.token_ids)
        tokens = [next(next_token) if item.samples else None for item in output.scheduled]
        self.scheduler.postprocess(output, tokens)

        deltas: list[RequestDelta] = []
        for item, logprobs in zip(sampling_items, sampled.logprobs, strict=True):
            request = self._requests.get(item.seq.request_id)
            if request is not None:
                deltas.append(self._advance(request, logprobs))
        return deltas

    def _advance(self, request: _Request, logprobs: TokenLogprobs | None) -> RequestDelta:
        seq = request.seq
        new_tokens = seq.token_ids[seq.num_prompt_tokens + request.delivered_tokens :]
        if new_tokens and seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        request.delivered_tokens += len(new_tokens)
        self.num_generated_tokens += len(new_tokens)
        delta = RequestDelta(
            seq.request_id, num_prompt_tokens=seq.num_prompt_tokens, token_ids=new_tokens
        )
        if logprobs is not None:
            delta.logprobs.append(logprobs)
        detokenizer = request.detokenizer
        for token in new_tokens:
            detokenizer.add_token(token)
        if detokenizer.stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        if seq.is_finished:
            return self._final_delta(request, delta, seq.finish_reason or "stop")
        delta.text = detokenizer.pop_delta()
        return delta

    def _final_delta(self, request: _Request, delta: RequestDelta, reason: str) -> RequestDelta:
        seq = request.seq
        del self._requests[seq.request_id]
        delta.text = request.detokenizer.pop_delta(final=True)
        delta.finish_reason = reason
        delta.usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=request.delivered_tokens,
            cached_tokens=seq.num_cached_tokens,
        )
        delta.timings = RequestTimings(
            arrival=seq.arrival_time,
            first_scheduled=seq.first_scheduled_time,
            first_token=seq.first_token_time,
            finished=time.monotonic(),
            num_preemptions=seq.num_preemptions,
        )
        return delta

    # -- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        stats["kv_block_size"] = self.options.block_size
        stats["num_generated_tokens"] = self.num_generated_tokens
        return stats
