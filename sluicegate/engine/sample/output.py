"""What a sampling pass hands back: the step's draws still on the device with their one
read to the host queued, and the tokens and logprobs that read unpacks into."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluicegate.engine.runner.readback import PendingRead, start_read


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and of the ``n`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class SampledBatch:
    """A step's draws still on the device (``tokens``, for the next step's inputs), with
    their one read to the host already queued; ``read()`` waits for it."""

    def __init__(
        self, tokens: torch.Tensor, packed: torch.Tensor | None, wanted: np.ndarray
    ) -> None:
        self.tokens = tokens
        self._wanted = wanted
        self._logprobs = packed is not None
        self._read: PendingRead = start_read(tokens if packed is None else packed)

    def read(self) -> SamplerOutput:
        rows = self._read.result()
        if not self._logprobs:
            return SamplerOutput(rows, [None] * len(rows))
        return unpack_logprobs(rows, self._wanted)


def pack_logprobs(
    raw_logprobs: torch.Tensor, tokens: torch.Tensor, wanted: np.ndarray
) -> torch.Tensor:
    """Tokens, each sampled token's logprob and every row's top alternatives, packed into
    one tensor so the step reads the device once."""
    k = int(np.amax(wanted))
    parts = [tokens[:, None].double(), raw_logprobs.gather(1, tokens[:, None]).double()]
    if k > 0:
        values, indices = raw_logprobs.topk(k, dim=-1)
        parts += [indices.double(), values.double()]
    return torch.cat(parts, dim=1)


def unpack_logprobs(rows: list[list[float]], wanted: np.ndarray) -> SamplerOutput:
    k = int(np.amax(wanted))
    token_ids = [int(row[0]) for row in rows]
    logprobs: list[TokenLogprobs | None] = []
    for row, n in zip(rows, map(int, wanted), strict=True):
        if n < 0:
            logprobs.append(None)
            continue
        ids, values = row[2 : 2 + k], row[2 + k :]
        top = [(int(ids[i]), values[i]) for i in range(n)]
        logprobs.append(TokenLogprobs(int(row[0]), row[1], top))
    return SamplerOutput(token_ids, logprobs)
