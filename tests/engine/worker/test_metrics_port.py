"""A second worker on one host: a taken metrics port moves to the next free one, logged."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest

from sluicegate.engine.worker.metrics import HealthServer, WorkerMetrics


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def test_taken_metrics_port_moves_to_the_next_free_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        server = HealthServer(WorkerMetrics("metrics-port-test"), "127.0.0.1", port)
        with caplog.at_level(logging.WARNING, logger="sluicegate.engine.worker.metrics"):
            await server.start()
        try:
            assert server.port > port
            assert f"metrics port {port} is taken" in caplog.text
            assert str(server.port) in caplog.text
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{server.port}/metrics")
            assert response.status_code == 200
        finally:
            await server.stop()


async def test_free_metrics_port_is_used_as_given(caplog: pytest.LogCaptureFixture) -> None:
    with _listening_socket() as probe:
        port = probe.getsockname()[1]
    server = HealthServer(WorkerMetrics("metrics-port-test"), "127.0.0.1", port)
    await server.start()
    try:
        assert server.port == port
        assert "is taken" not in caplog.text
    finally:
        await server.stop()
