"""Speculative decoding in the step loop: which sequences get draft tokens this step, and
how a verified step's results become each sequence's accepted tokens.

A step speculates only while few sequences run (``disable_by_batch_size``), only for
sequences in decode, and runs without overlap: proposals need the previous step's tokens
and the next step's schedule needs this one's accepted count. Requests whose sampling
depends on more than the logits (penalties, logit bias, a seed, logprobs) and
grammar-constrained ones are not speculated: they take their one token per step as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as SequenceOf

from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.scheduler_output import ScheduledSequence
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.spec.config import SpeculativeConfig
from sluicegate.engine.spec.ngram import propose_ngram


def speculable(params: SamplingParams) -> bool:
    """Whether verification reproduces this request's sampling exactly: its distribution
    is the logits' own (temperature, top-k/p, min-p) and its draws need no fixed keys."""
    return (
        not params.has_penalties
        and not params.logit_bias
        and params.logprobs is None
        and (params.greedy or params.seed is None)
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def active(self, num_running: int) -> bool:
        return 0 < num_running <= self.config.disable_by_batch_size

    def propose(
        self, running: SequenceOf[Sequence], eligible: Callable[[Sequence], bool]
    ) -> dict[str, list[int]]:
        """Draft tokens by request id for the running sequences in decode; never so many
        that the request's tokens could pass ``max_tokens``."""
        config = self.config
        drafts: dict[str, list[int]] = {}
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not eligible(seq):
                continue
            k = min(config.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)
            if k < 1:
                continue
            tokens = propose_ngram(
                seq.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max
            )
            if tokens:
                drafts[seq.request_id] = tokens
        return drafts

    def accept(
        self,
        scheduler: Scheduler,
        items: list[ScheduledSequence],
        verdicts: list[list[int]],
        sampled: list[int],
    ) -> tuple[list[int], list[ScheduledSequence]]:
        """Settle a verified step before ``Scheduler.advance``: each item keeps its leading
        accepted drafts, then one token (the first rejection's replacement, or the token
        sampled after the last draft when all are accepted). ``verdicts`` holds one
        [accepted, token] per draft token, item after item; ``sampled`` one token per item.
        A stop token among the accepted drafts ends the output there. Returns every item's
        next token and the items that rolled back."""
        tokens = list(sampled)
        rolled: list[ScheduledSequence] = []
        row = 0
        for index, item in enumerate(items):
            k = item.num_drafts
            if not k:
                continue
            seq = item.seq
            drafted = seq.token_ids[item.start + 1 : item.start + 1 + k]
            accepted = 0
            while accepted < k and verdicts[row + accepted][0]:
                accepted += 1
            token = verdicts[row + accepted][1] if accepted < k else sampled[index]
            row += k
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            for position, draft in enumerate(drafted[:accepted]):
                if scheduler.stops(seq, draft):
                    accepted, token = position, draft
                    break
            scheduler.accept_drafts(item, accepted)
            tokens[index] = token
            rolled.append(item)
        return tokens, rolled

    def stats(self) -> dict[str, float | int]:
        drafted = self.num_draft_tokens
        return {
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
        }
