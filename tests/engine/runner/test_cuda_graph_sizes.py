"""The padded batch sizes decode graphs are captured for (issue 12: 1, 2, 4, 8, then steps
of 8 up to max_num_seqs, which is always one of them)."""

from __future__ import annotations

from sluicegate.engine.runner.cuda_graphs import capture_sizes


def test_capture_sizes() -> None:
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
