"""The choices of the requests in flight, from their start to their last delta: forked from
choice 0 once its prompt is done (n > 1), advanced by each step's tokens (detokenized, stop
strings, grammar), ended by a finish or an abort. ``EngineCore`` owns one and asks it; the
step itself (schedule, forward, sample) stays in ``core.py``."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.scheduler_output import ScheduledSequence
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.protocol import Usage
from sluicegate.engine.runner.model_runner import ModelRunner
from sluicegate.engine.sample.output import TokenLogprobs
from sluicegate.engine.sample.slots import derived_seed
from sluicegate.engine.serving.request_delta import RequestDelta, RequestTimings, fill_text
from sluicegate.engine.text.choices import Choice, RequestGroup
from sluicegate.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LiveChoices:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        tool_parser: str | None,
        eos_token_ids: set[int],
    ) -> None:
        self._scheduler = scheduler
        self._runner = runner
        self._tokenizer = tokenizer
        self._tool_parser = tool_parser
        self._eos_token_ids = eos_token_ids
        self.by_seq: dict[str, Choice] = {}
        """Live choices by sequence id; a request's choice 0 has the request's own id."""
        self.groups: dict[str, RequestGroup] = {}
        self.num_guided = 0
        """Live choices with a grammar guide: while there are any, steps do not overlap."""
        self.num_unforked = 0
        """Live requests (n > 1) whose choices are still to be forked from choice 0."""
        self.num_generated_tokens = 0

    def add_group(self, group: RequestGroup, seq: Sequence) -> Choice:
        """A new request, its first sequence queued already: its choice 0."""
        self.groups[group.request_id] = group
        self.num_unforked += group.unforked
        return self._start(group, seq, 0)

    def _start(self, group: RequestGroup, seq: Sequence, index: int) -> Choice:
        choice = Choice.start(group, seq, index, self._tokenizer, self._tool_parser)
        self.by_seq[seq.request_id] = choice
        self.num_guided += choice.guide is not None
        return choice

    def abort(self, request_id: str) -> list[RequestDelta]:
        """Free the request's blocks now; the final delta of every choice still open (none if
        the request is not in flight)."""
        group = self.groups.get(request_id)
        if group is None:
            return []
        deltas = []
        live = {r.index: r for r in self.by_seq.values() if r.group is group}
        for index in range(group.n):
            if index in group.finished:
                continue
            request = live.get(index)
            if request is not None:
                self._scheduler.abort(request.seq.request_id)
                deltas.append(self._final_delta(request, RequestDelta(request_id), "abort"))
            else:
                deltas.append(self._close_unstarted(group, index))
        return deltas

    def _close_unstarted(self, group: RequestGroup, index: int) -> RequestDelta:
        delta = RequestDelta(group.request_id, index=index, finish_reason="abort")
        delta.usage = Usage(0, group.completion_tokens, group.num_cached_tokens)
        delta.done = group.finish(index)
        if delta.done:
            self._drop_group(group)
        return delta

    def _drop_group(self, group: RequestGroup) -> None:
        del self.groups[group.request_id]
        if group.unforked:  # ended before its prompt was done: it never forks
            group.unforked = False
            self.num_unforked -= 1

    def fork(
        self,
        sampling_items: list[ScheduledSequence],
        requests: list[Choice | None],
        scheduled: list[ScheduledSequence],
    ) -> list[int]:
        """Create choices 1..n-1 of every request whose prompt this step finished: they share
        its full KV blocks and get a copy of the partly filled last one, then sample from the
        same logits row. Appends them to the step's items; returns the rows they sample."""
        rows: list[int] = []
        for row in range(len(sampling_items)):
            request = requests[row]
            if request is None or not request.group.unforked:
                continue
            group, parent, item = request.group, request.seq, sampling_items[row]
            group.unforked = False
            self.num_unforked -= 1
            for index in range(1, group.n):
                params = group.params
                if params.seed is not None:
                    params = replace(params, seed=derived_seed(params.seed, index))
                child = Sequence(
                    f"{group.request_id}\x1f{index}",
                    parent.prompt_token_ids,
                    params,
                    self._eos_token_ids,
                    arrival_time=parent.arrival_time,
                    priority=parent.priority,
                    lora=parent.lora,
                )
                copies = self._scheduler.fork(parent, child, item.num_new_tokens, index)
                self._start(group, child, index)
                if copies is None:
                    continue  # no free block: it computes its own prompt (prefix-cache hits)
                self._runner.copy_blocks(copies)
                child_item = ScheduledSequence(child, item.num_new_tokens)
                sampling_items.append(child_item)
                scheduled.append(child_item)
                requests.append(self.by_seq[child.request_id])
                rows.append(row)
        return rows

    def advance(self, request: Choice, logprobs: TokenLogprobs | None, end: int) -> RequestDelta:
        """The delta of one choice's tokens up to ``end`` (a later step's placeholder may
        follow them already)."""
        seq = request.seq
        group = request.group
        new_tokens = seq.token_ids[seq.num_prompt_tokens + request.delivered_tokens : end]
        detokenizer = request.detokenizer
        for count, token in enumerate(new_tokens, 1):
            detokenizer.add_token(token)
            if detokenizer.stopped:
                # Accepted draft tokens past a stop string are never delivered.
                cut = count < len(new_tokens)
                new_tokens = new_tokens[:count]
                break
        else:
            cut = False
        if new_tokens and seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        request.delivered_tokens += len(new_tokens)
        group.completion_tokens += len(new_tokens)
        self.num_generated_tokens += len(new_tokens)
        delta = RequestDelta(
            group.request_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            token_ids=new_tokens,
            index=request.index,
        )
        if logprobs is not None:
            delta.logprobs.append(logprobs)
        # Ended by this token (length, EOS, stop token). A sequence can also be finished
        # by a later step still in flight (its length reached there): not yet ours to end.
        done = seq.is_finished and end >= seq.num_tokens and not cut
        stop = False
        for token in new_tokens:
            if not request.accept(token) and not done:
                logger.error("%s: the grammar refused token %d", seq.request_id, token)
                stop = True
        stop |= request.guide is not None and request.guide.terminated
        stop |= detokenizer.stopped
        if stop and not done:
            if seq.is_finished:
                seq.finish_reason = "stop"  # ends here, before the later step's length
            else:
                self._scheduler.finish(seq, "stop")
            done = True
        if done:
            return self._final_delta(request, delta, seq.finish_reason or "stop")
        fill_text(delta, request.route(detokenizer.pop_delta()))
        return delta

    def _final_delta(self, request: Choice, delta: RequestDelta, reason: str) -> RequestDelta:
        seq = request.seq
        group = request.group
        del self.by_seq[seq.request_id]
        self.num_guided -= request.guide is not None
        delta.index = request.index
        fill_text(delta, request.route(request.detokenizer.pop_delta(final=True), final=True))
        if reason == "stop" and request.output is not None and request.output.num_tool_calls:
            reason = "tool_calls"
        delta.finish_reason = reason
        if reason == "stop":
            delta.stop_sequence = request.detokenizer.stopped_by
        if request.index == 0:
            group.num_cached_tokens = seq.num_cached_tokens
        delta.done = group.finish(request.index)
        if delta.done:
            self._drop_group(group)
        delta.usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=group.completion_tokens,
            cached_tokens=group.num_cached_tokens,
        )
        delta.timings = RequestTimings(
            arrival=seq.arrival_time,
            first_scheduled=seq.first_scheduled_time,
            first_token=seq.first_token_time,
            finished=time.monotonic(),
            num_preemptions=seq.num_preemptions,
        )
        return delta
