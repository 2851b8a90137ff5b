"""The step loop shared by ``LLM`` and ``AsyncEngine``: schedule -> forward -> sample ->
postprocess -> detokenize and stop strings. Single-threaded: callers serialise access."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.kv_events.messages import KvEvent
from sluicegate.engine.lora import lora_manager
from sluicegate.engine.options import EngineOptions, resolve_device
from sluicegate.engine.runner.input_batch import StepArrays
from sluicegate.engine.runner.readback import PendingRead
from sluicegate.engine.sample.grammar import GrammarCompiler, GrammarSpec, request_grammar_spec
from sluicegate.engine.sample.guided import GrammarGuide, TokenBitmask
from sluicegate.engine.sample.output import SampledBatch
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.sample.sampler import Sampler
from sluicegate.engine.sample.slots import BatchRows
from sluicegate.engine.serving.core_build import load_model_side
from sluicegate.engine.serving.live_choices import LiveChoices
from sluicegate.engine.serving.request_delta import RequestDelta
from sluicegate.engine.serving.request_options import RequestOptions
from sluicegate.engine.serving.speculation import speculable
from sluicegate.engine.text.choices import RequestGroup
from sluicegate.engine.text.prompts import prompt_ids
from sluicegate.engine.text.reasoning import template_has_reasoning
from sluicegate.engine.text.tool_parsers import detect_tool_parser, make_tool_parser


@dataclass
class _Launched:
    """A step on the device whose sampled tokens have not been read yet."""

    output: SchedulerOutput
    sampling_items: list[ScheduledSequence]
    step: StepArrays
    sampled: SampledBatch
    forked: bool
    verdicts: PendingRead | None = None
    """A speculative step's draft verdicts ([accepted, token] per draft token)."""


class EngineCore:
    def __init__(self, model: str | Path, options: EngineOptions | None = None) -> None:
        options = options or EngineOptions()
        self.options = options
        self.device = resolve_device(options.device)
        if self.device.type == "cpu" and options.num_threads:
            torch.set_num_threads(options.num_threads)
        side = load_model_side(model, options, self.device)
        self.tokenizer, self.model, self.loras = side.tokenizer, side.model, side.loras
        self.runner, self.ranks = side.runner, side.ranks
        max_model_len = side.max_model_len
        config = self.model.config
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_kv_blocks=self.runner.num_kv_blocks,
                max_model_len=max_model_len,
                block_size=options.block_size,
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                enable_prefix_caching=options.enable_prefix_caching,
                max_waiting=options.max_waiting,
                max_loras=options.max_loras,
            )
        )
        if options.kv_events:
            self.scheduler.block_manager.record_events()
        self.sampler = Sampler(self.device, options.seed, max_rows=options.max_num_seqs)
        self.eos_token_ids = self.tokenizer.eos_token_ids | set(config.eos_token_ids)
        template = self.tokenizer.chat_template
        self.tool_parser = options.tool_parser or detect_tool_parser(template)
        if self.tool_parser is not None:
            make_tool_parser(self.tool_parser)  # an unknown name fails at startup
        self.reasoning = template_has_reasoning(template)
        self.grammars = GrammarCompiler(
            self.tokenizer.hf, config.vocab_size, sorted(self.eos_token_ids)
        )
        # Each token's bytes (for logprobs) come from a table built once, off the step loop.
        self.grammars.background(lambda: self.tokenizer.token_bytes(0))
        self.bitmask = TokenBitmask(config.vocab_size, options.max_num_seqs)
        self.choices = LiveChoices(
            self.scheduler, self.runner, self.tokenizer, self.tool_parser, self.eos_token_ids
        )
        self.async_scheduling = (
            self.device.type == "cuda"
            if options.async_scheduling is None
            else options.async_scheduling
        )
        self._in_flight: _Launched | None = None
        self.speculator = side.speculator
        self.started_at = time.monotonic()
        self.step_time_s = 0.0
        """Recent step duration (EWMA, the latest weighing 0.2; 0 until a step completed)."""

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (nothing else holds resources)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    # -- requests ---------------------------------------------------------------------------

    def prompt_ids(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        options: RequestOptions | None = None,
    ) -> list[int]:
        return prompt_ids(
            self.tokenizer,
            self.model.config.vocab_size,
            prompt,
            prompt_token_ids,
            messages,
            options,
        )

    def grammar_spec(self, options: RequestOptions) -> GrammarSpec | None:
        """What the request's output must match, or None (see ``sluicegate.engine.sample.grammar``)."""
        return request_grammar_spec(options, self.tool_parser)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
        compiled_grammar: object | None = None,
        chat: bool = False,
        *,
        resume_token_ids: list[int] | None = None,
    ) -> Sequence:
        """Queue a request; raises ``RequestRejected`` if it can never run here. A grammar the
        options need is compiled here unless ``compiled_grammar`` brings it already. Thinking
        text is told apart only in ``chat`` requests (a raw prompt's reply is all text).

        A resumed request continues after ``resume_token_ids`` (outputs an earlier attempt
        streamed): it goes on exactly as the uninterrupted request would, and its deltas carry
        only what comes after."""
        options = options or RequestOptions()
        vocab = self.model.config.vocab_size
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        resumed = list(resume_token_ids or [])
        if any(not 0 <= t < vocab for t in resumed):
            raise ValueError(f"resume token ids must be in [0, {vocab})")
        if resumed and options.n > 1:
            raise ValueError("a request with n > 1 cannot be resumed")
        lora = options.lora
        # Loaded on first use; one that cannot load (or LoRA off) rejects the request.
        adapter = lora_manager(self.loras).acquire(lora.name, lora.path) if lora else None
        if compiled_grammar is None:
            spec = self.grammar_spec(options)
            compiled_grammar = self.grammars.compile(spec) if spec is not None else None
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            self.eos_token_ids,
            output_token_ids=resumed,
            priority=options.priority,
            lora=adapter,
        )
        self.scheduler.add(seq)
        group = RequestGroup(
            request_id,
            options.n,
            params,
            options,
            compiled_grammar,
            unforked=options.n > 1,
            reasoning=chat and self.reasoning,
        )
        choice = self.choices.add_group(group, seq)
        if resumed:
            choice.replay(resumed)
        return seq

    def abort(self, request_id: str) -> list[RequestDelta]:
        """Free the request's blocks now; the final delta of every choice still open (none if
        the request is not in flight)."""
        return self.choices.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def live_request_ids(self) -> list[str]:
        return list(self.choices.groups)

    @property
    def num_generated_tokens(self) -> int:
        return self.choices.num_generated_tokens

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedule and launch one step; return the deltas of the step that completed.

        Without async scheduling that is the step just launched. With it, the step launched
        here is scheduled and prepared while the previous one may still run on the device
        (its sampled tokens are placeholders on the host and are fed to this step's inputs
        on the device); then the previous one is completed (read back, stop checks,
        detokenized) while this one runs, and its deltas are returned. A step that forked
        choices, or any live grammar-guided request (whose next mask needs the token just
        sampled), completes before the next one is scheduled."""
        began = time.perf_counter()
        deltas: list[RequestDelta] = []
        previous, self._in_flight = self._in_flight, None
        completes = previous is not None
        speculator = self.speculator
        speculates = speculator is not None and speculator.active(self.scheduler.num_running)
        if previous is not None and (self.choices.num_guided or speculates):
            deltas += self._complete(previous)
            previous = None
        drafts = None
        if speculates:
            assert speculator is not None
            drafts = speculator.propose(self.scheduler.running, self._speculable)
        output = self.scheduler.schedule(drafts)
        if drafts:
            assert speculator is not None
            speculator.fill(output, self.sampler.generator)
        launched = None if output.is_empty else self._launch(output)
        if previous is not None:
            deltas += self._complete(previous)
        if launched is not None:
            if (
                self.async_scheduling
                and not launched.forked
                and not self.choices.num_guided
                and launched.verdicts is None
            ):
                self._in_flight = launched
            else:
                deltas += self._complete(launched)
                completes = True
        if completes:  # a call that waited for a step on the device lasts about one step
            elapsed = time.perf_counter() - began
            self.step_time_s += (elapsed - self.step_time_s) * (0.2 if self.step_time_s else 1)
        return deltas

    def _speculable(self, seq: Sequence) -> bool:
        request = self.choices.by_seq.get(seq.request_id)
        if request is None or not speculable(seq.params):
            return False
        guide = request.guide
        # The grammar checks drafts only while it governs the output from its next token.
        return guide is None or (guide.active and guide.thinking_token is None)

    def _guide(self, request_id: str) -> GrammarGuide | None:
        request = self.choices.by_seq.get(request_id)
        return request.guide if request is not None else None

    def _launch(self, output: SchedulerOutput) -> _Launched:
        """Forward and sample ``output`` on the device, and do the bookkeeping that needs
        no sampled token; nothing here waits for the device. A step verifying draft
        tokens also queues their verdicts; its bookkeeping waits for them."""
        sampling_items = [item for item in output.scheduled if item.samples]
        verdicts = None
        if self.speculator is not None and any(item.num_drafts for item in sampling_items):
            logits, verdicts = self.speculator.verify(
                self.runner,
                self.sampler.generator,
                output,
                sampling_items,
                [self._guide(item.seq.request_id) for item in sampling_items],
                self.bitmask,
            )
        else:
            logits = self.runner.run(output)
        step = self.runner.last_step
        assert step is not None
        forked_rows: list[int] = []
        constrain = None
        # Choices to fork and grammars to apply are rare: most steps skip both passes.
        if self.choices.num_unforked or self.choices.num_guided:
            requests = [self.choices.by_seq.get(item.seq.request_id) for item in sampling_items]
            forked_rows = self.choices.fork(sampling_items, requests, output.scheduled)
            if forked_rows:
                rows = torch.tensor(forked_rows, device=logits.device)
                logits = torch.cat([logits, logits.index_select(0, rows)])
            # A speculated row was masked along its drafts already (Speculator.verify).
            guides = [
                r.guide if r is not None and not item.num_drafts else None
                for r, item in zip(requests, sampling_items, strict=False)
            ]
            if any(g is not None and g.active for g in guides):
                constrain = lambda rows: self.bitmask.apply(rows, guides)  # noqa: E731
        rows = BatchRows(step.sampling_batch_rows, step.sampling_generations,
                         step.sampling_positions)  # fmt: skip
        seqs = [item.seq for item in sampling_items]
        sampled = self.sampler.sample(logits, seqs, constrain, rows)
        if verdicts is not None:
            return _Launched(output, sampling_items, step, sampled, bool(forked_rows), verdicts)
        # The forked choices' rows come last; the runner tracks only its own rows.
        self.runner.mark_pending(step, sampled.tokens)
        self.scheduler.advance(output)
        return _Launched(output, sampling_items, step, sampled, bool(forked_rows))

    def _complete(self, launched: _Launched) -> list[RequestDelta]:
        """Read a launched step's tokens (its one wait for the device), put them in place of
        their placeholders, and turn them into deltas. A verified step first keeps each
        sequence's accepted drafts and rolls back the rest, then does its bookkeeping."""
        result = launched.sampled.read()
        tokens = result.token_ids
        if launched.verdicts is not None:
            assert self.speculator is not None
            tokens = self.speculator.settle(
                self.scheduler, self.runner, launched.output, launched.verdicts, tokens
            )
        else:
            self.runner.record_sampled(launched.step, tokens)
        self.scheduler.record(launched.output, tokens)
        deltas: list[RequestDelta] = []
        for item, logprobs in zip(launched.sampling_items, result.logprobs, strict=True):
            request = self.choices.by_seq.get(item.seq.request_id)
            if request is not None and item.token_index is not None:
                deltas.append(self.choices.advance(request, logprobs, item.token_index + 1))
        return deltas

    # -- state ------------------------------------------------------------------------------

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's changes since the last call (none unless ``options.kv_events``)."""
        return self.scheduler.block_manager.take_events()

    def stats(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        stats["kv_block_size"] = self.options.block_size
        stats["num_generated_tokens"] = self.num_generated_tokens
        stats["thinking"] = self.reasoning
        stats["step_time_s"] = self.step_time_s
        dtype = str(self.model.config.dtype).removeprefix("torch.")
        stats["dtype"] = dtype
        stats["weight_dtype"] = getattr(self.model, "weight_dtype", dtype)
        stats["kv_cache_dtype"] = str(self.runner.kv_cache.dtype).removeprefix("torch.")
        stats["tensor_parallel_size"] = self.options.tensor_parallel_size
        if self.speculator is not None:
            stats.update(self.speculator.stats())
        if self.loras is not None:
            stats.update(self.loras.stats())
        return stats
