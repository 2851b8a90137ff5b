"""The child processes ``sluicegate up`` (and the benches that start a system) run: each in a
process group of its own (so a terminal's Ctrl-C reaches only the parent, which stops them in
order), told by the kernel to exit if the parent dies, and stopped in reverse order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 15.0


def die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the parent goes away."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Stack:
    """Everything ``up`` started, stopped in reverse order."""

    children: list[Child] = field(default_factory=list)
    services: Any = None

    def spawn(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Child:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        log = log_path.open("ab")
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        child = Child(name, process, log_path, log)
        self.children.append(child)
        return child

    def stop(self) -> None:
        for child in reversed(self.children):
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            # The group may hold grandchildren even after the leader exited.
            child.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=5)
            child.log.close()
        self.children.clear()
        if self.services is not None:
            self.services.close()
            self.services = None
