"""Driving an ``EngineCore`` with requests that each name their own LoRA adapter (or none),
all in one batch, to the end."""

from __future__ import annotations

from pathlib import Path

from sluicegate.engine.protocol import LoraAdapter
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving.core import EngineCore
from sluicegate.engine.serving.request_options import RequestOptions


def run_mixed(
    core: EngineCore,
    requests: list[tuple[list[int], str | None, Path | None]],
    max_tokens: int,
) -> list[list[int]]:
    """Each (prompt, adapter name, adapter folder) request's greedy tokens, all queued
    before the first step so they share steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for index, (prompt, name, folder) in enumerate(requests):
        lora = LoraAdapter(name, str(folder)) if name is not None and folder else None
        request_id = f"r{index}"
        core.add_request(request_id, prompt, params, RequestOptions(lora=lora))
        outputs[request_id] = []
    while core.has_unfinished():
        for delta in core.step():
            outputs[delta.request_id].extend(delta.token_ids)
    return list(outputs.values())
