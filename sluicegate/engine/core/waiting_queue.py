"""The scheduler's waiting queue: by priority (lower first), first come first served within
one priority. It keeps what its sequences must compute once admitted (tokens, and the KV
blocks they fill) as sequences join and leave, so a heartbeat reads the queue's work without a
pass over it (``sluicegate.engine.worker.queue_estimate``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.core.sequence import Sequence


class WaitingQueue:
    """A deque of sequences with running sums. A waiting sequence's length does not change
    (a preempted one's placeholders are filled in place), so what joined is what leaves."""

    def __init__(self, block_size: int) -> None:
        self._queue: deque[Sequence] = deque()
        self._block_size = block_size
        self.num_tokens = 0
        """Tokens the waiting sequences hold (prompts, and preempted ones' outputs too)."""
        self.num_blocks = 0
        """KV blocks those tokens fill."""

    def append(self, seq: Sequence) -> None:
        """Behind every waiting sequence of its priority or a lower one."""
        queue = self._queue
        if not queue or queue[-1].priority <= seq.priority:
            queue.append(seq)  # the common case: one priority
        else:
            queue.insert(_first(queue, lambda s: s.priority > seq.priority), seq)
        self._count(seq, 1)

    def appendleft(self, seq: Sequence) -> None:
        """In front of every waiting sequence of its priority or a higher one (a preempted
        sequence goes back ahead of those that came after it, behind more urgent ones)."""
        queue = self._queue
        if not queue or queue[0].priority >= seq.priority:
            queue.appendleft(seq)
        else:
            queue.insert(_first(queue, lambda s: s.priority >= seq.priority), seq)
        self._count(seq, 1)

    def popleft(self) -> Sequence:
        seq = self._queue.popleft()
        self._count(seq, -1)
        return seq

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)
        self._count(seq, -1)

    def _count(self, seq: Sequence, sign: int) -> None:
        self.num_tokens += sign * seq.num_tokens
        self.num_blocks += sign * blocks_for(seq.num_tokens, self._block_size)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __getitem__(self, index: int) -> Sequence:
        return self._queue[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def __contains__(self, seq: object) -> bool:
        return seq in self._queue


def _first(queue: deque[Sequence], where: Callable[[Sequence], bool]) -> int:
    """The index of the first sequence ``where`` holds for, or the queue's length."""
    return next((i for i, seq in enumerate(queue) if where(seq)), len(queue))
