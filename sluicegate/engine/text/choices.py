"""A request's choices: each one's sequence, detokenizer, output parsers and grammar guide,
grouped under the client request they answer (``n`` choices share one prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.sample.guided import GrammarGuide
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving.request_options import RequestOptions
from sluicegate.engine.text.choice_output import ChoiceOutput, ChoiceText
from sluicegate.engine.text.reasoning import START, ReasoningSplitter, prompt_opens_reasoning
from sluicegate.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from sluicegate.engine.text.tool_parsers import make_tool_parser


@dataclass
class RequestGroup:
    """One client request: ``n`` choices sampled from one shared prompt."""

    request_id: str
    n: int
    params: SamplingParams
    options: RequestOptions
    compiled_grammar: object | None
    unforked: bool
    """Choices 1..n-1 are still to be forked from choice 0 once its prompt is computed."""
    reasoning: bool
    """Thinking text is split from the answer (a chat request to a thinking model)."""
    finished: set[int] = field(default_factory=set)
    completion_tokens: int = 0
    num_cached_tokens: int = 0

    def finish(self, index: int) -> bool:
        """Record that choice ``index`` ended; whether it was the last one open."""
        self.finished.add(index)
        return len(self.finished) == self.n


@dataclass
class Choice:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    group: RequestGroup
    index: int = 0
    output: ChoiceOutput | None = None
    guide: GrammarGuide | None = None
    delivered_tokens: int = 0

    @classmethod
    def start(
        cls,
        group: RequestGroup,
        seq: Sequence,
        index: int,
        tokenizer: Tokenizer,
        tool_parser: str | None,
    ) -> Choice:
        """A choice with only what its request needs: a plain one gets no parser or guide."""
        output = None
        thinking_token = None
        if group.reasoning or group.options.uses_tools:
            splitter = None
            if group.reasoning:
                tail = tokenizer.decode(seq.prompt_token_ids[-4:])
                splitter = ReasoningSplitter(prompt_opens_reasoning(tail))
                if not splitter.decided:
                    thinking_token = tokenizer.single_token_id(START)
            parser = None
            if group.options.uses_tools and tool_parser is not None:
                parser = make_tool_parser(tool_parser)
            output = ChoiceOutput(splitter, parser, group.options.parallel_tool_calls)
        guide = None
        if group.compiled_grammar is not None:
            active = output is None or output.in_answer
            guide = GrammarGuide(group.compiled_grammar, active, thinking_token)
        detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, seq.params.stop)
        return cls(seq, detokenizer, group, index, output, guide)

    def accept(self, token: int) -> bool:
        """Advance the grammar (if any) by a sampled token; False if it refuses it."""
        return self.guide is None or self.guide.accept(token)

    def route(self, text: str, final: bool = False) -> ChoiceText:
        """Split newly detokenized text into answer, reasoning and tool-call fragments, and
        switch the grammar on once the answer begins."""
        if self.output is None:
            return ChoiceText(content=text)
        routed = self.output.feed(text) if text else ChoiceText()
        if final:
            rest = self.output.finish()
            routed.content += rest.content
            routed.reasoning += rest.reasoning
            routed.tool_calls += rest.tool_calls
        if self.guide is not None and not self.guide.active:
            self.guide.active = self.output.in_answer
        return routed

    def replay(self, resumed: list[int]) -> None:
        """Bring a resumed choice's grammar, detokenizer and parsers to where the earlier
        attempt left off; what they would emit for that part was delivered already."""
        delivered = self.detokenizer.replay(resumed)
        self.delivered_tokens = len(resumed)
        self.group.completion_tokens = len(resumed)
        for token in resumed:
            self.accept(token)
        self.route(delivered)
