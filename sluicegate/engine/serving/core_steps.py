"""What happens between two engine steps, wherever the core runs (a thread of the asyncio
front, or a process of its own): queued requests join, queued aborts land."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sluicegate.engine.lora import lora_manager
from sluicegate.engine.protocol import Usage
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving.core import EngineCore
from sluicegate.engine.serving.request_delta import RequestDelta
from sluicegate.engine.serving.request_options import RequestOptions


@dataclass(eq=False)
class PendingRequest:
    """A request on its way into the scheduler: exactly one of prompt, prompt_token_ids,
    messages (tokenized when it joins), and its grammar compiling meanwhile."""

    request_id: str
    params: SamplingParams
    options: RequestOptions
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[Any] | None = None
    chat: bool = False
    """Thinking text is told apart (chat requests only; implied by ``messages``)."""
    grammar: Future[Any] | None = None
    """The request's grammar, compiling off the step loop; it waits until this is done."""
    resume_token_ids: list[int] | None = None

    @property
    def ready(self) -> bool:
        return self.grammar is None or self.grammar.done()


def apply(
    core: EngineCore, pending: list[PendingRequest], aborts: set[str]
) -> tuple[list[RequestDelta], list[tuple[str, ValueError]]]:
    """Add the ready requests and apply the aborts (``aborts`` is consumed); returns the
    aborted requests' final deltas and the requests that cannot run, with why."""
    deltas: list[RequestDelta] = []
    errors: list[tuple[str, ValueError]] = []
    for request in pending:
        if request.request_id in aborts:
            aborts.discard(request.request_id)
            deltas.append(abort_delta(request.request_id))
            continue
        try:
            ids = core.prompt_ids(
                request.prompt, request.prompt_token_ids, request.messages, request.options
            )
            grammar = request.grammar.result() if request.grammar is not None else None
            core.add_request(
                request.request_id,
                ids,
                request.params,
                request.options,
                grammar,
                chat=request.chat or request.messages is not None,
                resume_token_ids=request.resume_token_ids,
            )
        except ValueError as exc:
            errors.append((request.request_id, exc))
    for request_id in aborts:
        deltas.extend(core.abort(request_id))
    aborts.clear()
    return deltas, errors


def control(core: EngineCore, name: str, path: str | None) -> dict[str, Any]:
    """Load the LoRA adapter ``name`` from ``path`` (unload it: ``path`` None); the stats
    after it. Raises ``ValueError`` with the reason it cannot."""
    loras = lora_manager(core.loras)
    if path is None:
        loras.unload(name)
    else:
        loras.load(name, path)
    return core.stats()


def abort_delta(request_id: str) -> RequestDelta:
    """The final delta of a request aborted before it reached the scheduler."""
    return RequestDelta(request_id, finish_reason="abort", usage=Usage(0, 0, 0), done=True)


def abort_all(core: EngineCore) -> None:
    for request_id in list(core.live_request_ids()):
        core.abort(request_id)
