"""Fixtures shared by the CPU model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two intra-op threads for the test, the count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
