"""Speculative decoding in the step loop: which sequences get draft tokens this step, and
how a verified step's results become each sequence's accepted tokens.

A step speculates only while few sequences run (``disable_by_batch_size``), only for
sequences in decode, and runs without overlap: proposals need the previous step's tokens
and the next step's schedule needs this one's accepted count. Requests whose sampling
depends on more than the logits (penalties, logit bias, a seed, logprobs) and
grammar-constrained ones are speculated with the grammar checking the drafts (each verified
row masked by the grammar's state after the drafts before it); those whose output may open
with a thinking block, or that are still thinking, are not: they take one token a step.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.runner.model_runner import ModelRunner
from sluicegate.engine.runner.readback import PendingRead, start_read
from sluicegate.engine.sample.guided import GrammarGuide, TokenBitmask
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.sample.speculative import verify_drafts
from sluicegate.engine.spec.config import SpeculativeConfig
from sluicegate.engine.spec.draft_model import DraftModel
from sluicegate.engine.spec.ngram import propose_ngram

DRAFT_PLACEHOLDER = 0
"""What a draft model's draft tokens read as between scheduling (which reserves their slots)
and the draft's forward passes (which fill them in, before anything reads them)."""


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
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"speculative method {config.method!r} with draft model {draft!r}")
        self.config = config
        self.draft = draft
        self._draft_probs: torch.Tensor | None = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def active(self, num_running: int) -> bool:
        return 0 < num_running <= self.config.disable_by_batch_size

    def propose(
        self, running: SequenceOf[Sequence], eligible: Callable[[Sequence], bool]
    ) -> dict[str, list[int]]:
        """Draft tokens by request id for the running sequences in decode; never so many
        that the request's tokens could pass ``max_tokens``. A draft model's are
        placeholders until ``fill`` (after scheduling has reserved their slots)."""
        config = self.config
        drafts: dict[str, list[int]] = {}
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not eligible(seq):
                continue
            k = min(config.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)
            if k < 1:
                continue
            if self.draft is not None:
                drafts[seq.request_id] = [DRAFT_PLACEHOLDER] * k
                continue
            tokens = propose_ngram(
                seq.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max
            )
            if tokens:
                drafts[seq.request_id] = tokens
        return drafts

    def fill(self, output: SchedulerOutput, generator: torch.Generator) -> None:
        """A draft model's tokens in place of the placeholders of the items scheduled with
        drafts, and the distributions they were drawn from (for ``verify``)."""
        items = [item for item in output.scheduled if item.samples and item.num_drafts]
        if self.draft is None or not items:
            return
        self._draft_probs = self.draft.propose(items, generator)

    def verify(
        self,
        runner: ModelRunner,
        generator: torch.Generator,
        output: SchedulerOutput,
        items: list[ScheduledSequence],
        guides: SequenceOf[GrammarGuide | None],
        bitmask: TokenBitmask,
    ) -> tuple[torch.Tensor, PendingRead]:
        """Forward a step with draft tokens (``items``: those that sample): the logits
        after each item's last token, from which the sampler draws the token that follows
        all its drafts, and the drafts' verdicts with their read queued. A guided item's rows
        are masked by its grammar along its drafts (``guides``: one per item, or None), the
        last one included: the sampler must not mask that row again."""
        num_drafts = np.array([item.num_drafts for item in items], dtype=np.int64)
        logits = runner.run_speculative(output, num_drafts)
        last = np.cumsum(num_drafts + 1) - 1
        chains = [
            (
                int(end - item.num_drafts),
                guide,
                item.seq.token_ids[item.start + 1 :][: item.num_drafts],
            )
            for item, guide, end in zip(items, guides, last, strict=True)
            if guide is not None and guide.active and item.num_drafts
        ]
        if chains:
            bitmask.apply_to_drafts(logits, chains)
        drafted = np.ones(len(logits), dtype=bool)
        drafted[last] = False
        drafts = [t for i in items for t in i.seq.token_ids[i.start + 1 :][: i.num_drafts]]
        params = [i.seq.params for i in items for _ in range(i.num_drafts)]
        device = logits.device
        verdicts = verify_drafts(
            logits[torch.from_numpy(np.flatnonzero(drafted)).to(device)],
            np.array(drafts, dtype=np.int64),
            params,
            generator,
            self._draft_probs,
        )
        self._draft_probs = None
        return logits[torch.from_numpy(last).to(device)], start_read(verdicts)

    def settle(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        output: SchedulerOutput,
        verdicts: PendingRead,
        sampled: list[int],
    ) -> list[int]:
        """A verified step's bookkeeping, up to ``Scheduler.advance``: each item keeps its
        leading accepted drafts, then one token (the first rejection's replacement, or the
        token sampled after the last draft when all are accepted); the rest roll back in
        the scheduler and in the runner's batch rows. ``sampled`` has one token per item
        that samples. A stop token among the accepted drafts ends the output there.
        Returns each such item's next token, for ``Scheduler.record``."""
        tokens = list(sampled)
        rows = verdicts.result()
        row = 0
        items = [item for item in output.scheduled if item.samples]
        for index, item in enumerate(items):
            k = item.num_drafts
            if not k:
                continue
            seq = item.seq
            drafted = seq.token_ids[item.start + 1 : item.start + 1 + k]
            accepted = 0
            while accepted < k and rows[row + accepted][0]:
                accepted += 1
            token = rows[row + accepted][1] if accepted < k else sampled[index]
            row += k
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            for position, draft in enumerate(drafted[:accepted]):
                if scheduler.stops(seq, draft):
                    accepted, token = position, draft
                    break
            scheduler.accept_drafts(item, accepted)
            runner.rollback(seq.batch_row, seq.batch_generation, seq.num_tokens,
                            len(seq.block_table))  # fmt: skip
            tokens[index] = token
        scheduler.advance(output)
        return tokens

    def stats(self) -> dict[str, float | int]:
        drafted = self.num_draft_tokens
        return {
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
        }
