"""What an OpenAI upstream answers model ``rich`` with: everything the chat API can carry.

Two choices (one calling two tools, one refusing), logprobs with top alternatives and bytes,
``reasoning_content`` (vLLM's and DeepSeek's field), a ``system_fingerprint`` and usage with
cached and reasoning token details; the stream sends the same, as OpenAI streams it (tool-call
``id``/``name`` first, then ``arguments`` fragments, choices interleaved by ``index``).
"""

from __future__ import annotations

from typing import Any

CREATED = 1_750_000_000
FINGERPRINT = "fp_rich_0001"


def _logprob(token: str, logprob: float) -> dict[str, Any]:
    alternatives = [
        {"token": token, "logprob": logprob, "bytes": list(token.encode())},
        {"token": "x", "logprob": logprob - 2.5, "bytes": [120]},
    ]
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": alternatives,
    }


TOOL_CALLS = [
    {
        "id": "call_weather_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    },
    {
        "id": "call_time_2",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
    },
]

USAGE = {
    "prompt_tokens": 31,
    "completion_tokens": 17,
    "total_tokens": 48,
    "prompt_tokens_details": {"cached_tokens": 8, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 5, "audio_tokens": 0},
}

COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-upstream-rich",
    "object": "chat.completion",
    "created": CREATED,
    "model": "rich",
    "system_fingerprint": FINGERPRINT,
    "service_tier": "default",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "reasoning_content": "The user wants weather and time.",
                "tool_calls": TOOL_CALLS,
                "annotations": [],
            },
            "logprobs": {"content": [_logprob("Let", -0.25)], "refusal": None},
            "finish_reason": "tool_calls",
        },
        {
            "index": 1,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": "I can't help with that.",
                "annotations": [],
            },
            "logprobs": {"content": None, "refusal": [_logprob("I", -0.5)]},
            "finish_reason": "stop",
        },
    ],
    "usage": USAGE,
}


def _chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-upstream-rich",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": "rich",
        "system_fingerprint": FINGERPRINT,
        "choices": choices,
    }
    if usage is not None or not choices:
        chunk["usage"] = usage
    return chunk


def _delta(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None} | extra


def chunks(include_usage: bool) -> list[dict[str, Any]]:
    """The stream; with ``include_usage`` every chunk has ``usage: null`` and a last chunk
    without choices carries the usage, as OpenAI sends it."""
    stream = [
        _chunk([_delta(0, {"role": "assistant", "content": None, "refusal": None})]),
        _chunk([_delta(1, {"role": "assistant", "content": None, "refusal": None})]),
        _chunk([_delta(0, {"reasoning_content": "The user wants "})]),
        _chunk([_delta(0, {"reasoning_content": "weather and time."})]),
        _chunk(
            [
                _delta(
                    0,
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_weather_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    },
                    logprobs={"content": [_logprob("Let", -0.25)], "refusal": None},
                )
            ]
        ),
        _chunk([_delta(1, {"refusal": "I can't "})]),
        _chunk([_delta(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})]),
        _chunk(
            [
                _delta(
                    0,
                    {
                        "tool_calls": [
                            {"index": 0, "function": {"arguments": '"Paris", "unit": "c"}'}}
                        ]
                    },
                )
            ]
        ),
        _chunk([_delta(1, {"refusal": "help with that."})]),
        _chunk(
            [
                _delta(
                    0,
                    {
                        "tool_calls": [
                            {
                                "index": 1,
                                "id": "call_time_2",
                                "type": "function",
                                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
                            }
                        ]
                    },
                )
            ]
        ),
        _chunk([_delta(0, {}, finish_reason="tool_calls")]),
        _chunk([_delta(1, {}, finish_reason="stop")]),
    ]
    if not include_usage:
        return stream
    for chunk in stream:
        chunk["usage"] = None
    return [*stream, _chunk([], USAGE)]
