"""Soak: mixed traffic through two gateways and two workers while the pieces fail.

For ``--minutes`` it keeps ``--clients`` concurrent clients busy (alternating streamed and
non-streamed chat requests, greedy and seeded) against two gateway processes in front of two
engine workers (the tiny demo model), all on a redis-server and a PostgreSQL server this
script starts for itself (never the shared ones). Meanwhile, at fixed fractions of the run, it
SIGKILLs a worker (and later starts it again), SIGKILLs a gateway (later starts it again),
restarts Redis and stops PostgreSQL for a while.

Redis runs as a Redis holding billing events must: with its append-only file, so a restart
(SIGTERM, then start) keeps what was written. A Redis that comes back *empty* loses whatever
it alone held: usage events not yet flushed to PostgreSQL (the flush interval's worth) and
requests queued but not yet pulled (the gateway re-submits those); tests/e2e/
test_redis_restart.py covers that case.

What a client does, and how each request counts (a request is one logical client call):
- A connection refused, or an HTTP 5xx before any answer, is retried on the other gateway
  (as a load balancer or the OpenAI SDK's retries would), up to 4 tries; this is not a cut.
- A response cut mid-way because the gateway serving it was SIGKILLed cannot be retried
  without paying twice: it counts as ``gateway_killed_in_flight`` (reported on its own), and
  its usage must still be settled by the surviving gateway.
- ``completed``: a full answer (finish_reason, and for streams the final [DONE]).
- ``cut``: every other outcome: an error event or error status after retries, a dropped
  connection from a gateway that was not killed, a hang past the client timeout.

Usage, from the PostgreSQL rows once everything settled:
- ``usage_lost``: a completed request without its row, or whose row bills fewer tokens than the
  answer's own usage; a gateway-killed request without a row, or billing fewer completion
  tokens than the content chunks its client received.
- ``usage_doubled``: a row billing more than the answer's usage (completed), more than
  max_tokens (gateway-killed), any tokens for an attempt that never got an answer or for a
  request id no client saw.
- ``budget_overshoot``: tokens billed in the usage rows that the key's budget counter in Redis
  does not hold once all is settled (a budget could be overspent by that much; the counter is
  re-seeded from PostgreSQL after the Redis restart). ``budget_leak`` is the reverse: counted
  tokens no row bills (reservations never given back).

Targets: cut == usage_lost == usage_doubled == budget_overshoot == 0. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This script's folder would shadow the `kernels` package with bench/kernels.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MASTER_KEY = "sk-admin-soak-" + uuid.uuid4().hex
LEASE_S = 3.0
CLIENT_TIMEOUT_S = 90.0
MODEL = "soak-tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- processes -----------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    user: str | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = self.argv
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        self.popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def send(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen is None:
            return
        self.send(sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.popen.wait(5)
        self.popen = None


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=1.0).status_code == 200


class Services:
    """A private redis-server and PostgreSQL cluster, which the soak may stop and restart."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.redis_port = free_port()
        self.pg_port = free_port()
        self.pg_dir = root / "pg"
        self.pg_user = "postgres" if os.geteuid() == 0 else None
        env = dict(os.environ)
        self.redis = Proc(
            "redis",
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
             "--dir", str(root)],
            env, root / "redis.log",
        )  # fmt: skip
        self.postgres = Proc(
            "postgres",
            [shutil.which("postgres") or "postgres", "-D", str(self.pg_dir),
             "-p", str(self.pg_port), "-k", str(self.pg_dir), "-c", "listen_addresses=127.0.0.1",
             "-c", "fsync=off", "-c", "max_connections=100"],
            env, root / "postgres.log", user=self.pg_user,
        )  # fmt: skip

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def database_url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.pg_port}/postgres"

    def start_redis(self) -> None:
        import redis

        self.redis.start()
        client = redis.Redis(port=self.redis_port, socket_connect_timeout=0.2)
        wait_for(client.ping, 10, "redis-server")
        client.close()

    def init_postgres(self) -> None:
        self.pg_dir.mkdir()
        (self.root / "postgres.log").touch()
        if self.pg_user:
            shutil.chown(self.root, self.pg_user)
            shutil.chown(self.pg_dir, self.pg_user)
            shutil.chown(self.root / "postgres.log", self.pg_user)
        initdb = [shutil.which("initdb") or "initdb", "-D", str(self.pg_dir), "-A", "trust",
                  "-U", "postgres", "--no-sync"]  # fmt: skip
        if self.pg_user:
            initdb = ["runuser", "-u", self.pg_user, "--", *initdb]
        subprocess.run(initdb, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start_postgres(self) -> None:
        self.postgres.start()

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", self.pg_port), timeout=0.5):
                pass
            return (
                subprocess.run(
                    ["pg_isready", "-h", "127.0.0.1", "-p", str(self.pg_port)],
                    capture_output=True,
                ).returncode
                == 0
            )

        wait_for(ready, 30, "postgres")

    def stop_postgres(self) -> None:
        self.postgres.stop(signal.SIGINT)  # fast shutdown: what an outage looks like to clients

    def close(self) -> None:
        self.postgres.stop(signal.SIGINT)
        self.redis.stop(signal.SIGKILL)


class Stack:
    """Two workers and two gateways over the private services."""

    def __init__(self, root: Path, services: Services, model_dir: Path) -> None:
        self.root = root
        self.services = services
        self.model_dir = model_dir
        self.usage_stream = f"sg:usage:soak:{uuid.uuid4().hex[:6]}"
        self.gateway_ports = [free_port(), free_port()]
        # Routes from a config, as production runs: a model stays known while Redis restarts
        # (discovery from worker heartbeats would call it unknown until they come back).
        self.routing_config = root / "routing.yaml"
        self.routing_config.write_text(
            f"models:\n  - name: {MODEL}\n    deployments:\n"
            f"      - provider: engine\n        model: {MODEL}\n"
        )
        self.workers = [self._worker(i) for i in range(2)]
        self.gateways = [self._gateway(i) for i in range(2)]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        return env

    def _worker(self, index: int) -> Proc:
        argv = [
            sys.executable, "-m", "sluicegate.engine.worker", "--model", str(self.model_dir),
            "--served-model-name", MODEL, "--redis-url", self.services.redis_url,
            "--worker-id", f"soak-w{index}", "--metrics-port", "0", "--metrics-host", "127.0.0.1",
            "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
            "--max-num-seqs", "8", "--claim-idle", "2", "--heartbeat-ttl", "2",
            "--drain-timeout", "5",
        ]  # fmt: skip
        return Proc(f"worker{index}", argv, self._env(), self.root / f"worker{index}.log")

    def _gateway(self, index: int) -> Proc:
        env = self._env()
        env.update(
            SLUICEGATE_CONFIG=str(self.routing_config),
            SLUICEGATE_DATABASE_URL=self.services.database_url,
            SLUICEGATE_REDIS_URL=self.services.redis_url,
            SLUICEGATE_MASTER_KEY=MASTER_KEY,
            SLUICEGATE_USAGE_STREAM=self.usage_stream,
            SLUICEGATE_USAGE_FLUSH_INTERVAL_S="0.2",
            SLUICEGATE_WORKER_HEARTBEAT_TTL_S="2",
            SLUICEGATE_LEASE_S=str(LEASE_S),
            SLUICEGATE_REQUEST_TIMEOUT_S="60",
        )
        argv = [sys.executable, "-m", "sluicegate.gateway.cli", "gateway", "--host", "127.0.0.1",
                "--port", str(self.gateway_ports[index]), "--log-level", "warning"]  # fmt: skip
        return Proc(f"gateway{index}", argv, env, self.root / f"gateway{index}.log")

    def base_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[index]}"

    def start_gateway(self, index: int) -> None:
        self.gateways[index].start()
        wait_for(lambda: http_ok(f"{self.base_url(index)}/health/ready"), 60, "a gateway")

    def start_worker(self, index: int) -> None:
        self.workers[index].start()

    def wait_model(self) -> None:
        def listed() -> bool:
            response = httpx.get(
                f"{self.base_url(0)}/v1/models",
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=5,
            )
            return any(m["id"] == MODEL for m in response.json()["data"])

        wait_for(listed, 120, "the model to be served")

    def create_key(self, budget: int) -> None:
        response = httpx.post(
            f"{self.base_url(0)}/admin/keys",
            headers={"Authorization": f"Bearer {MASTER_KEY}"},
            json={"name": "soak", "token_budget": budget},
            timeout=10,
        )
        response.raise_for_status()
        self.api_key, self.key_id = response.json()["key"], response.json()["id"]

    def close(self) -> None:
        for proc in [*self.gateways, *self.workers]:
            proc.stop()


# ---- traffic -------------------------------------------------------------------------------


@dataclass
class Attempt:
    gateway: int
    request_id: str | None = None
    answered: bool = False


@dataclass
class Outcome:
    streamed: bool
    max_tokens: int
    attempts: list[Attempt] = field(default_factory=list)
    status: str = "cut"  # completed | cut | gateway_killed
    usage: tuple[int, int] | None = None
    content_chunks: int = 0
    detail: str = ""


class Traffic:
    def __init__(self, stack: Stack, clients: int, seed: int) -> None:
        self.stack = stack
        self.clients = clients
        self.random = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.killed_at: dict[int, float] = {}
        self.down: set[int] = set()
        self.stopping = asyncio.Event()
        self.counter = 0

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        while not self.stopping.is_set():
            self.counter += 1
            outcome = Outcome(streamed=self.counter % 2 == 0, max_tokens=self.random.randint(8, 40))
            self.outcomes.append(outcome)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Soak {self.counter}: tell a story."}],
                "max_tokens": outcome.max_tokens,
                "temperature": 0 if self.counter % 3 else 0.8,
                "seed": self.counter,
                "ignore_eos": True,
            }
            first = self.random.randrange(2)
            for attempt_no in range(4):
                gateway = (first + attempt_no) % 2
                attempt = Attempt(gateway)
                outcome.attempts.append(attempt)
                retry = await self._attempt(client, body, outcome, attempt)
                if not retry:
                    break
                await asyncio.sleep(0.2 * (attempt_no + 1))

    async def _attempt(
        self, client: httpx.AsyncClient, body: dict[str, Any], outcome: Outcome, attempt: Attempt
    ) -> bool:
        """One try; True when the client should try again (nothing was answered)."""
        url = f"{self.stack.base_url(attempt.gateway)}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {self.stack.api_key}"}
        if outcome.streamed:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                attempt.request_id = response.headers.get("x-request-id")
                if response.status_code >= 500:
                    await response.aread()
                    outcome.detail = f"HTTP {response.status_code}"
                    return True
                if response.status_code != 200:
                    outcome.detail = (
                        f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    )
                    return False
                attempt.answered = True
                if outcome.streamed:
                    await self._read_stream(response, outcome)
                else:
                    answer = json.loads(await response.aread())
                    usage = answer["usage"]
                    outcome.usage = (usage["prompt_tokens"], usage["completion_tokens"])
                    outcome.status = "completed"
        except (httpx.ConnectError, httpx.ConnectTimeout):
            outcome.detail = "connection refused"
            return True
        except httpx.TransportError as exc:
            killed = self.killed_at.get(attempt.gateway)
            if not attempt.answered:
                outcome.detail = f"dropped before an answer: {type(exc).__name__}"
                return True
            if killed is not None and abs(time.monotonic() - killed) < 5:
                outcome.status = "gateway_killed"
            outcome.detail = f"dropped: {type(exc).__name__}"
        return False

    async def _read_stream(self, response: httpx.Response, outcome: Outcome) -> None:
        finished = done = False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outcome.detail = f"error event: {event['error'].get('message', '')[:200]}"
                return
            for choice in event.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    outcome.content_chunks += 1
                finished = finished or choice.get("finish_reason") is not None
            if event.get("usage"):
                usage = event["usage"]
                outcome.usage = (usage["prompt_tokens"], usage["completion_tokens"])
        if finished and done and outcome.usage is not None:
            outcome.status = "completed"
        else:
            outcome.detail = outcome.detail or "stream ended without finishing"


# ---- chaos ---------------------------------------------------------------------------------


async def chaos(stack: Stack, traffic: Traffic, seconds: float, events: list[str]) -> None:
    """Breaks things at fixed fractions of the run."""
    services = stack.services
    began = time.monotonic()

    async def at(fraction: float) -> None:
        await asyncio.sleep(max(0.0, began + fraction * seconds - time.monotonic()))

    def note(what: str) -> None:
        events.append(f"{time.monotonic() - began:6.1f}s {what}")
        log(what)

    await at(0.12)
    stack.workers[1].send(signal.SIGKILL)
    note("SIGKILL worker 1")
    await at(0.22)
    await asyncio.to_thread(stack.start_worker, 1)
    note("worker 1 started again")
    await at(0.32)
    traffic.killed_at[1] = time.monotonic()
    stack.gateways[1].send(signal.SIGKILL)
    note("SIGKILL gateway 1")
    await at(0.40)
    await asyncio.to_thread(stack.start_gateway, 1)
    note("gateway 1 started again")
    await at(0.52)
    await asyncio.to_thread(services.redis.stop, signal.SIGTERM)
    note("redis-server stopped")
    await asyncio.to_thread(services.start_redis)
    note("redis-server started again")
    await at(0.70)
    await asyncio.to_thread(services.stop_postgres)
    note("PostgreSQL stopped")
    await at(0.82)
    await asyncio.to_thread(services.start_postgres)
    note("PostgreSQL started again")


# ---- accounting ----------------------------------------------------------------------------


async def usage_rows(database_url: str, key_id: str) -> dict[str, dict[str, Any]]:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(
                text(
                    "SELECT request_id, prompt_tokens, completion_tokens, status "
                    "FROM usage_records WHERE key_id = :key_id"
                ),
                {"key_id": key_id},
            )
            return {row.request_id: dict(row._mapping) for row in result}
    finally:
        await engine.dispose()


def account(
    outcomes: list[Outcome],
    rows: dict[str, dict[str, Any]],
    budget_counter: int,
    problems: list[str],
) -> dict[str, Any]:
    lost = doubled = 0
    sent: set[str] = set()
    for outcome in outcomes:
        for attempt in outcome.attempts:
            if attempt.request_id:
                sent.add(attempt.request_id)
        final = outcome.attempts[-1] if outcome.attempts else None
        for attempt in outcome.attempts:
            row = rows.get(attempt.request_id or "")
            if attempt is final and outcome.status == "completed":
                billed = None if row is None else (row["prompt_tokens"], row["completion_tokens"])
                if billed is None or sum(billed) < sum(outcome.usage or (0, 0)):
                    lost += 1
                    problems.append(f"lost {attempt.request_id}: {billed} < {outcome.usage}")
                elif billed != outcome.usage:
                    doubled += 1
                    problems.append(f"doubled {attempt.request_id}: {billed} > {outcome.usage}")
            elif attempt is final and outcome.status == "gateway_killed":
                if row is None or row["completion_tokens"] < outcome.content_chunks:
                    lost += 1
                    problems.append(f"lost {attempt.request_id} (gateway killed): {row}")
                elif row["completion_tokens"] > outcome.max_tokens:
                    doubled += 1
                    problems.append(f"doubled {attempt.request_id} (gateway killed): {row}")
            elif not attempt.answered and row is not None:
                if row["prompt_tokens"] + row["completion_tokens"] > 0:
                    doubled += 1
                    problems.append(f"billed unanswered {attempt.request_id}: {row}")
    # A request the client never got an id for (the gateway was killed while admitting it) is
    # settled by the reaper; it must bill nothing, since nothing was generated for anyone.
    unknown = [
        rid
        for rid in set(rows) - sent
        if rows[rid]["prompt_tokens"] + rows[rid]["completion_tokens"] > 0
    ]
    doubled += len(unknown)
    problems += [f"billed a request no client saw: {rows[rid]}" for rid in unknown]
    billed = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
    return {
        "usage_lost": lost,
        "usage_doubled": doubled,
        "budget_overshoot": max(0, billed - budget_counter),
        "budget_leak": max(0, budget_counter - billed),
    }


# ---- main ----------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    import redis.asyncio as aioredis

    seconds = args.minutes * 60
    traffic = Traffic(stack, args.clients, args.seed)
    events: list[str] = []
    started = time.monotonic()
    runner = asyncio.create_task(traffic.run())
    log(f"traffic for {seconds:.0f}s with {args.clients} clients")
    await chaos(stack, traffic, seconds, events)
    await asyncio.sleep(max(0.0, started + seconds - time.monotonic()))
    traffic.stopping.set()
    await runner
    log("traffic stopped; waiting for usage to settle")
    # Every answered request settles within lease_s (+ a reap and a flush); be generous.
    expected = {a.request_id for o in traffic.outcomes for a in o.attempts if a.request_id}
    deadline = time.monotonic() + LEASE_S + 30
    rows: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        rows = await usage_rows(stack.services.database_url, stack.key_id)
        if expected <= set(rows):
            break
        await asyncio.sleep(1.0)
    client = aioredis.Redis.from_url(stack.services.redis_url)
    try:
        counter = int(await client.get(f"sg:rl:{{{stack.key_id}}}:b:all") or 0)
    finally:
        await client.aclose()
    outcomes = traffic.outcomes
    problems: list[str] = []
    result: dict[str, Any] = {
        "requests": len(outcomes),
        "completed": sum(o.status == "completed" for o in outcomes),
        "cut": sum(o.status == "cut" for o in outcomes),
        "gateway_killed_in_flight": sum(o.status == "gateway_killed" for o in outcomes),
        **account(outcomes, rows, counter, problems),
        "streamed": sum(o.streamed for o in outcomes),
        "retried": sum(len(o.attempts) > 1 for o in outcomes),
        "minutes": args.minutes,
    }
    for event in events:
        log(event)
    cuts = [o.detail for o in outcomes if o.status == "cut"]
    if cuts:
        log(f"cut requests: {cuts[:10]}")
    for problem in problems[:20]:
        log(problem)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the logs folder")
    args = parser.parse_args()

    from sluicegate.engine.demo_model import create_demo_model
    from sluicegate.gateway.db.migrate import upgrade

    root = Path(tempfile.mkdtemp(prefix="sg-soak-"))
    os.chmod(root, 0o755)
    log(f"logs in {root}")
    services = Services(root)
    stack: Stack | None = None
    try:
        services.start_redis()
        services.init_postgres()
        services.start_postgres()
        upgrade(services.database_url)
        model_dir = create_demo_model(root / "model")
        stack = Stack(root, services, model_dir)
        for index in range(2):
            stack.start_worker(index)
            stack.start_gateway(index)
        stack.create_key(budget=10**12)
        stack.wait_model()
        result = asyncio.run(soak(args, stack))
    finally:
        if stack is not None:
            stack.close()
        services.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
