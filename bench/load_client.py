"""The load generator of ``gateway_overhead.py``: prebuilt requests over minimal keep-alive
HTTP/1.1 connections, so that the client's own cost stays small and equal for every path it
times (direct, ours, the peers, a baseline checkout)."""

from __future__ import annotations

import asyncio
import socket
import time

LATENCY_BLOCK_ROUNDS = 100
"""Sequential rounds a gateway runs before the next one takes its turn."""


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class Connection:
    """One keep-alive HTTP/1.1 connection that sends prebuilt requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        return cls(reader, writer)

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lowered = head.lower()
        if b"transfer-encoding: chunked" in lowered:
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    return status, body
                body += chunk[:-2]
        return status, await self.reader.readexactly(content_length(head))

    def close(self) -> None:
        self.writer.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency_rounds(
    direct: tuple[int, bytes], gateway: tuple[int, bytes], rounds: int
) -> tuple[list[float], list[float], int]:
    """Sequential requests, one at a time, to the upstream directly and through the gateway,
    interleaved in rounds (the order flips every round): (direct ms, gateway ms, errors)."""
    direct_conn = await Connection.open(direct[0])
    gateway_conn = await Connection.open(gateway[0])
    direct_ms: list[float] = []
    gateway_ms: list[float] = []
    errors = 0

    async def timed(conn: Connection, raw: bytes, into: list[float]) -> None:
        nonlocal errors
        started = time.perf_counter()
        status, _ = await conn.send(raw)
        into.append((time.perf_counter() - started) * 1000)
        errors += status != 200

    for i in range(rounds):
        if i % 2:
            await timed(gateway_conn, gateway[1], gateway_ms)
            await timed(direct_conn, direct[1], direct_ms)
        else:
            await timed(direct_conn, direct[1], direct_ms)
            await timed(gateway_conn, gateway[1], gateway_ms)
    direct_conn.close()
    gateway_conn.close()
    return direct_ms, gateway_ms, errors


async def latency_blocks(
    direct: tuple[int, bytes], gateways: dict[str, tuple[int, bytes]], rounds: int
) -> dict[str, tuple[list[float], list[float], int]]:
    """``latency_rounds`` for every gateway, ``rounds`` each, in blocks taken in turn, so that
    a drift in this machine's speed (tens of percent within minutes) touches all alike. Each
    gateway is alone in its block: a gateway's work after its answers (settling, logging)
    falls on its own block, as it would on a machine of its own, not on another's requests."""
    timed: dict[str, tuple[list[float], list[float], int]] = {
        name: ([], [], 0) for name in gateways
    }
    blocks = max(1, rounds // LATENCY_BLOCK_ROUNDS)
    for block in range(blocks):
        size = rounds // blocks + (block < rounds % blocks)
        for name, gateway in gateways.items():
            direct_ms, gateway_ms, errors = await latency_rounds(direct, gateway, size)
            so_far = timed[name]
            timed[name] = (so_far[0] + direct_ms, so_far[1] + gateway_ms, so_far[2] + errors)
    return timed


async def throughput(port: int, raw: bytes, clients: int, seconds: float) -> tuple[float, int, int]:
    """Returns (requests/s, errors, requests)."""
    connections = [await Connection.open(port) for _ in range(clients)]
    done = 0
    errors = 0
    stop_at = 0.0

    async def client(conn: Connection) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            status, _ = await conn.send(raw)
            done += 1
            errors += status != 200

    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(client(c) for c in connections))
    elapsed = time.perf_counter() - started
    for conn in connections:
        conn.close()
    return done / elapsed, errors, done
