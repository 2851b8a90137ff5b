"""``sluicegate up`` on the embedded default: it serves, and Ctrl-C leaves no process behind."""

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


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process we can see."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        table[int(entry.name)] = (ppid, cmdline)
    return table


def _related(root: int, data_dir: Path) -> set[int]:
    """Descendants of ``root`` plus anything running from the data dir (daemonized servers)."""
    table = _processes()
    found = {root}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _) in table.items():
            if ppid in found and pid not in found:
                found.add(pid)
                changed = True
    found |= {pid for pid, (_, cmd) in table.items() if str(data_dir) in cmd}
    return found - {os.getpid()}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_up_serves_the_demo_model_and_sigint_stops_everything(
    up_scratch_dir: Path, tools: SimpleNamespace
) -> None:
    # up_scratch_dir, not tmp_path: the embedded PostgreSQL (another user) must traverse it.
    data_dir = up_scratch_dir / "sg-data"
    port = tools.free_port()
    env = tools.base_env()  # no SLUICEGATE_* URLs: embedded PostgreSQL and Redis
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sluicegate.gateway.cli",
            "up",
            "--demo",
            "random",
            "--data-dir",
            str(data_dir),
            "--port",
            str(port),
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert up.stdout is not None
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
        model = re.search(r"model:\s+(\S+)", output)
        assert api_key and model, output
        assert "curl " in output and "from openai import OpenAI" in output
        assert re.search(r"admin key:\s+\S+", output)

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key.group(1))
        reply = client.chat.completions.create(
            model=model.group(1), messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1

        related = _related(up.pid, data_dir)
        assert len(related) >= 4, "expected up, gateway, engine, PostgreSQL and Redis"
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        leftovers: set[int] = set()
        for _ in range(50):
            leftovers = {pid for pid in related | _related(up.pid, data_dir) if _alive(pid)}
            if not leftovers:
                break
            time.sleep(0.1)
        table = _processes()
        assert not leftovers, [table.get(pid) for pid in leftovers]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
