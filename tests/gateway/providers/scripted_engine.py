"""A scripted engine worker: it speaks the engine's Redis wire protocol (heartbeat, request
stream, reply stream) and answers each request with one delta, keeping the requests it got, so
a test sees exactly what the gateway sent an engine. It reads the model's shared stream and its
own (where prefix affinity and LoRA requests go), and announces LoRA support when asked."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from sluicegate.engine import protocol, redis_names


class ScriptedWorker:
    """Answers request ``n`` (from 1) of its model with the text ``answer n``."""

    def __init__(
        self, redis_url: str, model: str, *, max_loras: int = 0, loras: tuple[str, ...] = ()
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.loras = list(loras)
        self.worker_id = f"scripted-{uuid.uuid4().hex[:6]}"
        self.requests: list[protocol.Request] = []
        self._redis = redis.Redis.from_url(redis_url)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ScriptedWorker:
        self._beat()
        self._redis.sadd(redis_names.worker_registry(self.model), self.worker_id)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._redis.delete(
            redis_names.request_stream(self.model),
            redis_names.worker_stream(self.model, self.worker_id),
            redis_names.worker_registry(self.model),
            redis_names.heartbeat_key(self.model, self.worker_id),
        )
        self._redis.close()

    def _beat(self) -> None:
        beat = protocol.Heartbeat(
            self.worker_id,
            self.model,
            self.model,
            "test",
            time.time(),
            max_loras=self.max_loras,
            loras=self.loras,
        )
        self._redis.set(
            redis_names.heartbeat_key(self.model, self.worker_id), protocol.encode(beat), ex=60
        )

    def _run(self) -> None:
        after = {
            redis_names.request_stream(self.model): b"0-0",
            redis_names.worker_stream(self.model, self.worker_id): b"0-0",
        }
        while not self._stopping.is_set():
            self._beat()
            for stream, entries in self._redis.xread(after, block=200) or []:
                for entry_id, fields in entries:
                    after[stream.decode()] = entry_id
                    request = protocol.decode(fields[redis_names.MESSAGE_FIELD])
                    assert isinstance(request, protocol.Request)
                    self.requests.append(request)
                    self._answer(request, f"answer {len(self.requests)}")

    def _answer(self, request: protocol.Request, text: str) -> None:
        delta = protocol.Delta(
            request.request_id,
            0,
            text,
            [1, 2],
            finish_reason="stop",
            usage=protocol.Usage(len(request.messages or ()), 2),
            worker_id=self.worker_id,
            produced=2,
        )
        self._redis.xadd(request.reply_key(), {redis_names.MESSAGE_FIELD: protocol.encode(delta)})
