"""Issue 14: ``sluicegate up --model`` on an architecture with no native implementation (a tiny
Phi-3) serves streaming /v1/chat/completions through the transformers backend, and the
streamed text is transformers' own greedy continuation of the chat-templated prompt."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "What is paged attention?"}]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Random Phi-3 weights with the demo model's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    folder = tmp_path_factory.mktemp("phi3")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Phi3ForCausalLM(config).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def transformers_reply(model_dir: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def test_up_serves_a_phi3_checkpoint_with_streaming(
    phi3_dir: Path,
    tmp_path: Path,
    tools: SimpleNamespace,
    admin_database_url: str,
    redis_url: str,
) -> None:
    database_url, drop_database = tools.new_database(admin_database_url)
    port = tools.free_port()
    env = tools.base_env(SLUICEGATE_DATABASE_URL=database_url, SLUICEGATE_REDIS_URL=redis_url)
    served = tools.model_name("phi3")
    up = subprocess.Popen(
        [
            sys.executable, "-m", "sluicegate.gateway.cli", "up",
            "--model", str(phi3_dir),
            "--served-model-name", served,
            "--model-impl", "auto",
            "--data-dir", str(tmp_path / "sg-data"),
            "--port", str(port),
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        output = "".join(lines)
        assert "Press Ctrl-C" in output, output
        api_key = re.search(r"API key:\s+(\S+)", output)
        assert api_key, output

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key.group(1))
        stream = client.chat.completions.create(
            model=served,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert len([p for p in pieces if p]) > 1, "expected the reply in several chunks"
        # The streaming detokenizer withholds the bytes of a character the last tokens left
        # unfinished, where a one-shot decode shows U+FFFD for each.
        assert "".join(pieces) == transformers_reply(phi3_dir).rstrip("\ufffd")
        assert usage is not None and 1 <= usage.completion_tokens <= MAX_TOKENS
        assert finish in {"stop", "length"}

        engine_log = (tmp_path / "sg-data" / "logs" / "engine.log").read_text()
        assert "the transformers implementation (model_impl=auto)" in engine_log
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        drop_database()
