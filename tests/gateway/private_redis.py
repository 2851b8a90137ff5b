"""A redis-server of one test's own, which the test may take down (keeping its data, as a
Redis with persistence does across an outage) and bring back on the same port."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.gateway.topologies.redis_servers import free_ports, redis_server


class PrivateRedis:
    def __init__(self) -> None:
        self.port = free_ports(1)[0]
        self.workdir = Path(tempfile.mkdtemp(prefix="sg-private-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    assert time.monotonic() < deadline, "private redis-server did not start"
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Down, its data saved to disk first: ``start`` brings it back with everything."""
        if self.process is None:
            return
        client = redis.Redis(port=self.port)
        try:
            client.shutdown(save=True)
        except redis.ConnectionError:
            pass  # the answer to SHUTDOWN is the connection closing
        finally:
            client.close()
        self.process.wait(10)
        self.process = None

    def crash(self) -> None:
        """Down without saving: ``start`` then brings it back empty."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def close(self) -> None:
        self.crash()
        shutil.rmtree(self.workdir, ignore_errors=True)
