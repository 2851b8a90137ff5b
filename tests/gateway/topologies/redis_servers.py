"""Real Redis topologies started from ``redis-server`` for one test module each.

``ClusterOfThree``: three masters sharing the 16,384 slots, joined with CLUSTER MEET.
``SentinelPair``: a master, a replica and one Sentinel watching them (quorum 1), so a test can
fail the master over.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

SLOTS = 16384
SENTINEL_SERVICE = "sgmaster"

SLOW_INCR = """
redis.call('incr', KEYS[1])
local function now() local t = redis.call('time') return t[1] * 1e6 + t[2] end
local deadline = now() + 600000
while now() < deadline do end
return 1
"""
"""A script that books (INCR) and then holds the server for 0.6 s: a client timing out on
it must not send it again, and any other client's command waits it out."""


def redis_server() -> str:
    path = shutil.which("redis-server")
    assert path, "redis-server is needed (apt-get install redis-server); .ci/run installs it"
    return path


def _free(port: int) -> bool:
    """Nothing holds ``port``: not a listener, nor the local end of a connection."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """Ports whose cluster-bus twin (port + 10000) is free too, both below the ephemeral
    range: there the kernel hands ports to the local ends of outgoing connections, and a
    suite that opens thousands of them can take a bus port between this check and the
    server's bind (redis-server then exits, and the start times out)."""
    ceiling = _ephemeral_low() - 10000 - 1
    ports: list[int] = []
    while len(ports) < count:
        port = random.randint(10000, ceiling)
        if port not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def _wait(check: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _Servers:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, port: int, *args: str) -> None:
        directory = self.workdir / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        argv = [redis_server(), *args] if args and args[0].endswith(".conf") else [
            redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(directory), *args,
        ]  # fmt: skip
        log_path = directory / "server.log"
        process = subprocess.Popen(argv, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
        self.processes.append(process)
        client = redis.Redis(port=port, socket_connect_timeout=0.2)

        def up() -> bool:
            # A server that could not start says why at once, not after the whole timeout.
            assert process.poll() is None, f"redis-server on {port} exited: {log_path.read_text()}"
            return bool(client.ping())

        _wait(up, f"redis-server on {port}")
        client.close()

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


class ClusterOfThree(_Servers):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.ports = free_ports(3)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> ClusterOfThree:
        for port in self.ports:
            self.spawn(port, "--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                       "--cluster-config-file", f"nodes-{port}.conf")  # fmt: skip
        clients = [redis.Redis(port=p) for p in self.ports]
        share = SLOTS // len(self.ports) + 1
        for index, client in enumerate(clients):
            slots = range(index * share, min(SLOTS, (index + 1) * share))
            client.execute_command("CLUSTER", "ADDSLOTS", *slots)
        for port in self.ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)

        def formed() -> bool:
            return all(
                c.cluster("INFO")["cluster_state"] == "ok"
                and len(c.cluster("NODES")) == len(self.ports)
                for c in clients
            )

        _wait(formed, "the cluster to form")
        for client in clients:
            client.close()
        return self


class SentinelPair(_Servers):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.master_port, self.replica_port, self.sentinel_port = free_ports(3)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SENTINEL_SERVICE}/0"

    def sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, decode_responses=True)

    def master_port_now(self) -> int:
        host_port = self.sentinel().sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
        return int(host_port[1])

    def start(self) -> SentinelPair:
        self.spawn(self.master_port)
        self.spawn(self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port))
        replica = redis.Redis(port=self.replica_port, decode_responses=True)
        _wait(lambda: replica.info("replication")["master_link_status"] == "up", "replication")
        replica.close()
        directory = self.workdir / str(self.sentinel_port)
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "sentinel.conf"
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n"
            f"sentinel failover-timeout {SENTINEL_SERVICE} 10000\n"
        )
        self.spawn(self.sentinel_port, str(config), "--sentinel")

        def knows_replica() -> bool:
            return len(self.sentinel().sentinel_slaves(SENTINEL_SERVICE)) == 1

        _wait(knows_replica, "the Sentinel to find the replica", timeout_s=30)
        return self

    def fail_over(self) -> None:
        before = self.master_port_now()
        self.sentinel().execute_command("SENTINEL", "FAILOVER", SENTINEL_SERVICE)
        _wait(lambda: self.master_port_now() != before, "the failover", timeout_s=30)
        promoted = redis.Redis(port=self.master_port_now(), decode_responses=True)
        _wait(lambda: promoted.info("replication")["role"] == "master", "the new master")
        promoted.close()
