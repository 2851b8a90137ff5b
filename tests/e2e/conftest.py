"""Real processes for end-to-end tests: engine workers and gateways as subprocesses.

Workers take a few seconds to load, so a gateway (in discovery mode: it serves every model
that has a live worker) and its freshly migrated database live for the whole session, and each
test module starts the workers it needs under a model name of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MASTER_KEY = "sk-admin-e2e-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)

    def wait_ready(self, url: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"{self.name} exited early:\n{self.log()}")
            if http_ok(url):
                return
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready after {timeout}s:\n{self.log()}")


def spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path, port: int) -> Process:
    log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
    popen = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Process(name, popen, log_path, port)


def base_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
    env.update(PYTHONUNBUFFERED="1", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.update(overrides)
    return env


@dataclass
class Cluster:
    """Starts workers and gateways, and stops every one of them at teardown."""

    log_dir: Path
    model_dir: Path
    processes: list[Process] = field(default_factory=list)

    def worker(self, model_name: str, redis_url: str, *extra: str, ready: bool = True) -> Process:
        port = free_port()
        argv = [
            sys.executable, "-m", "sluicegate.engine.worker",
            "--model", str(self.model_dir),
            "--served-model-name", model_name,
            "--redis-url", redis_url,
            "--metrics-port", str(port),
            "--metrics-host", "127.0.0.1",
            "--device", "cpu",
            "--dtype", "float32",
            "--num-kv-blocks", "256",
            "--drain-timeout", "5",
            *extra,
        ]  # fmt: skip
        process = spawn(f"worker-{model_name}", argv, base_env(), self.log_dir, port)
        self.processes.append(process)
        if ready:
            process.wait_ready(f"http://127.0.0.1:{port}/health/ready")
        return process

    def gateway(self, database_url: str, redis_url: str, **settings: str) -> Process:
        port = free_port()
        # A usage stream of its own: gateways of other test runs on the shared Redis would
        # otherwise flush this one's usage events into their databases.
        settings = {"usage_stream": f"sg:usage:e2e:{uuid.uuid4().hex[:8]}", **settings}
        env = base_env(
            SLUICEGATE_DATABASE_URL=database_url,
            SLUICEGATE_REDIS_URL=redis_url,
            SLUICEGATE_MASTER_KEY=MASTER_KEY,
            SLUICEGATE_USAGE_FLUSH_INTERVAL_S="0.1",
            SLUICEGATE_WORKER_HEARTBEAT_TTL_S="3",
            **{f"SLUICEGATE_{k.upper()}": v for k, v in settings.items()},
        )
        argv = [sys.executable, "-m", "sluicegate.gateway.cli", "gateway", "--port", str(port)]
        argv += ["--log-level", "warning"]
        process = spawn("gateway", argv, env, self.log_dir, port)
        self.processes.append(process)
        process.wait_ready(f"http://127.0.0.1:{port}/health/ready", timeout=60)
        return process

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sluicegate.engine.demo_model import create_demo_model

    return create_demo_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("e2e-logs"), tiny_model_dir)
    yield cluster
    cluster.close()


def new_database(admin_url: str) -> tuple[str, Callable[[], None]]:
    """A migrated database of its own and the function that drops it."""
    from sluicegate.gateway.db.scratch import scratch_database

    stack = contextlib.ExitStack()
    url = stack.enter_context(scratch_database(admin_url, prefix="sg_e2e"))
    return url, stack.close


@pytest.fixture(scope="session")
def e2e_database_url(admin_database_url: str) -> Iterator[str]:
    url, drop = new_database(admin_database_url)
    yield url
    drop()


@dataclass
class Gateway:
    process: Process
    database_url: str
    api_key: str
    key_id: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.process.port}"

    def openai(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, **kwargs)

    def wait_model(self, model: str, timeout: float = 30.0) -> None:
        def listed() -> bool:
            response = httpx.get(
                f"{self.base_url}/v1/models",
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=5,
            )
            return response.status_code == 200 and any(
                m["id"] == model for m in response.json()["data"]
            )

        wait_until(listed, timeout, f"model {model} in /v1/models", interval=0.2)

    def usage_rows(self, request_ids: list[str] | None = None) -> list[dict[str, Any]]:
        return asyncio.run(_usage_rows(self.database_url, self.key_id, request_ids))

    def wait_usage_rows(self, count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []

        def enough() -> bool:
            nonlocal rows
            rows = self.usage_rows()
            return len(rows) >= count

        wait_until(enough, timeout, f"{count} usage rows", interval=0.2)
        return rows


async def _usage_rows(
    database_url: str, key_id: str, request_ids: list[str] | None
) -> list[dict[str, Any]]:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(
                text(
                    "SELECT request_id, model, prompt_tokens, completion_tokens, status, "
                    "finish_reason FROM usage_records WHERE key_id = :key_id"
                ),
                {"key_id": key_id},
            )
            rows = [dict(row._mapping) for row in result]
    finally:
        await engine.dispose()
    if request_ids is not None:
        rows = [r for r in rows if r["request_id"] in request_ids]
    return rows


def create_key(base_url: str, name: str, **limits: Any) -> tuple[str, str]:
    """A new API key (``limits``: the admin API's, e.g. ``rpm_limit``); (plaintext, id)."""
    response = httpx.post(
        f"{base_url}/admin/keys",
        headers={"Authorization": f"Bearer {MASTER_KEY}"},
        json={"name": name, **limits},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    body = response.json()
    return body["key"], body["id"]


@pytest.fixture(scope="session")
def gateway_process(cluster: Cluster, e2e_database_url: str, redis_url: str) -> Process:
    return cluster.gateway(e2e_database_url, redis_url)


@pytest.fixture(scope="module")
def gateway(gateway_process: Process, e2e_database_url: str) -> Gateway:
    """The shared gateway, with an API key of this module's own (its usage rows are ours)."""
    base_url = f"http://127.0.0.1:{gateway_process.port}"
    key, key_id = create_key(base_url, f"e2e-{uuid.uuid4().hex[:6]}")
    return Gateway(gateway_process, e2e_database_url, key, key_id)


def model_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


_METRIC = re.compile(r'^(sluicegate:[a-z_]+)\{model_name="[^"]*"\} (\S+)$', re.MULTILINE)


def worker_metrics(worker: Process) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{worker.port}/metrics", timeout=2).text
    return {name: float(value) for name, value in _METRIC.findall(text)}


@pytest.fixture(scope="session")
def tools() -> SimpleNamespace:
    """Helpers for the test modules (a conftest is not importable under importlib mode)."""
    return SimpleNamespace(
        wait_until=wait_until,
        worker_metrics=worker_metrics,
        model_name=model_name,
        free_port=free_port,
        create_key=create_key,
        admin_headers={"Authorization": f"Bearer {MASTER_KEY}"},
        new_database=new_database,
        base_env=base_env,
        spawn=spawn,
        Gateway=Gateway,
    )


class Reference:
    """Greedy outputs of ``LLM`` for the tiny model, and the text after each of their tokens."""

    def __init__(self, model_dir: Path) -> None:
        from sluicegate.engine import LLM
        from sluicegate.engine.text.tokenizer import Tokenizer

        self.llm = LLM(str(model_dir), num_kv_blocks=256, device="cpu", dtype="float32")
        self.tokenizer = Tokenizer(model_dir)

    def chat(self, prompt: str, max_tokens: int) -> Any:
        from sluicegate.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return self.llm.chat([[{"role": "user", "content": prompt}]], params)[0]

    def chat_many(self, prompts: list[str], max_tokens: int) -> list[Any]:
        """``chat`` for several prompts in one batched run (each row is its own greedy answer)."""
        from sluicegate.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return self.llm.chat([[{"role": "user", "content": p}] for p in prompts], params)

    def texts_after_each_token(self, output: Any) -> list[str]:
        """``texts[k]`` is what a client has seen once the first ``k`` tokens were streamed."""
        from sluicegate.engine.text.tokenizer import IncrementalDetokenizer

        detokenizer = IncrementalDetokenizer(self.tokenizer, output.prompt_token_ids)
        texts, seen = [""], ""
        for token in output.token_ids:
            detokenizer.add_token(token)
            seen += detokenizer.pop_delta()
            texts.append(seen)
        return texts

    def tokens_shown(self, output: Any, text: str) -> int:
        """How many tokens a client holding ``text`` was shown: the first k whose text it is."""
        texts = self.texts_after_each_token(output)
        assert text in texts, f"{text!r} is not a prefix the engine could have streamed"
        return texts.index(text)


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@dataclass
class Up:
    """A running ``sluicegate up`` (embedded PostgreSQL and Redis, the demo model)."""

    base_url: str
    api_key: str
    admin_key: str
    model: str
    model_dir: Path

    def openai(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, **kwargs)

    def anthropic(self, api_key: str | None = None, **kwargs: Any) -> Any:
        import anthropic

        kwargs.setdefault("max_retries", 0)
        key = api_key or self.api_key
        return anthropic.Anthropic(base_url=self.base_url, api_key=key, **kwargs)

    def create_key(self, name: str, **limits: Any) -> str:
        """A new API key through the admin API (``limits``: e.g. ``rpm_limit``)."""
        response = httpx.post(
            f"{self.base_url}/admin/keys",
            headers={"Authorization": f"Bearer {self.admin_key}"},
            json={"name": name, **limits},
            timeout=10,
        )
        assert response.status_code == 201, response.text
        return str(response.json()["key"])


@contextlib.contextmanager
def up_scratch() -> Iterator[Path]:
    """A fresh folder for a ``sluicegate up`` data dir, removed afterwards. Not under pytest's
    basetemp: the embedded PostgreSQL runs as another user (we are root) and needs every parent
    directory traversable, while any pytest starting meanwhile on this machine resets
    /tmp/pytest-of-<user> to 0700."""
    scratch = Path(tempfile.mkdtemp(prefix="sg-up-"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def up_scratch_dir() -> Iterator[Path]:
    """``up_scratch`` for one test."""
    with up_scratch() as scratch:
        yield scratch


@pytest.fixture(scope="session")
def up() -> Iterator[Up]:
    """One ``sluicegate up`` for every test module that drives the SDKs against it (starting
    one takes PostgreSQL, Redis, a migration and a model load)."""
    with up_scratch() as scratch:
        yield from _up(scratch / "sg-data")


def _up(data_dir: Path) -> Iterator[Up]:
    port = free_port()
    # The random demo: small and fast (test_up_demo.py serves the SmolLM2 one).
    argv = [sys.executable, "-m", "sluicegate.gateway.cli", "up", "--demo", "random"]
    argv += ["--data-dir", str(data_dir)]
    process = subprocess.Popen(
        [*argv, "--port", str(port)],
        cwd=REPO_ROOT,
        env=base_env(),  # no SLUICEGATE_* URLs: embedded PostgreSQL and Redis
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (line := process.stdout.readline()):
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        output = "".join(lines)
        found = {
            name: re.search(rf"{label}:\s+(\S+)", output)
            for name, label in (("api_key", "API key"), ("admin", "admin key"), ("model", "model"))
        }
        assert all(found.values()) and "Press Ctrl-C" in output, output
        # Whatever it prints later must not fill the pipe and stall it.
        threading.Thread(target=process.stdout.read, daemon=True).start()
        model = found["model"].group(1)  # type: ignore[union-attr]
        yield Up(
            base_url=f"http://127.0.0.1:{port}",
            api_key=found["api_key"].group(1),  # type: ignore[union-attr]
            admin_key=found["admin"].group(1),  # type: ignore[union-attr]
            model=model,
            model_dir=data_dir / "models" / model,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
