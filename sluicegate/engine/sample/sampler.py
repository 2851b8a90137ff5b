"""Turns the logits of the sampled positions into next tokens, one batched pass per step.

Each random row draws one uniform and inverts its distribution's CDF at it; seeded rows take
that uniform from a counter-based hash of (seed, output position) alone
(``sluicegate.engine.sample.batched.counter_uniform``), so a seeded request samples the same
tokens whatever its batch mates are and however often it was preempted, recomputed or
resumed. Settings live in per-sequence slots of host arrays, penalties in device count
tensors updated by one scatter per step, and the step's results (tokens and logprobs) come
back to the host in one read.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from sluicegate.engine.sample.batched import (
    PenaltyCounts,
    argmax_rows,
    counter_uniform,
    filtered_probs,
    sample_from_probs,
)
from sluicegate.engine.sample.output import SampledBatch, SamplerOutput, pack_logprobs
from sluicegate.engine.sample.slots import BatchRows, SampledSequence, SlotParams


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None, max_rows: int = 0) -> None:
        """``max_rows``: the persistent batch's rows (``BatchRows``), if the caller has one."""
        self.max_rows = max_rows
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._slots: SlotParams | None = None
        self._penalties: PenaltyCounts | None = None
        self._free_penalty_rows: list[int] = []

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[SampledSequence],
        constrain: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        return self.sample(logits, seqs, constrain).read()

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[SampledSequence],
        constrain: Callable[[torch.Tensor], None] | None = None,
        batch_rows: BatchRows | None = None,
    ) -> SampledBatch:
        """``constrain`` masks forbidden tokens in place (grammars); logprobs are taken from
        the model's raw distribution before it, as vLLM does. One device-to-host read,
        queued here and waited for by ``read()``."""
        vocab = logits.shape[1]
        if self._slots is None or self._slots.vocab != vocab:
            self._slots, self._penalties = SlotParams(vocab, self.max_rows), None
            self._free_penalty_rows = []
        slots_state = self._slots
        slots, joined, positions = self._slots_of(slots_state, seqs, batch_rows)
        column = {name: values[slots] for name, values in slots_state.columns.items()}
        logits = logits.float()
        want_logprobs = column["logprobs"] >= 0
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs.any() else None
        if constrain is not None:
            constrain(logits)
        if column["penalized"].any():
            logits = self._penalize(logits, seqs, slots, joined, column)
        biased = np.flatnonzero(column["biased"])
        if len(biased):
            logits = self._add_bias(logits, biased, slots)

        greedy = column["greedy"]
        if greedy.all():  # an empty step (no row samples) included
            tokens = argmax_rows(logits)
        else:
            greedy_tokens = argmax_rows(logits) if greedy.any() else None
            tokens = self._sample_random(logits, greedy_tokens, column, positions)
        if self._penalties is not None and column["penalized"].any():
            rows = np.flatnonzero(column["penalized"])
            self._penalties.add_tokens(
                torch.from_numpy(slots_state.penalty_row[slots[rows]]).to(self.device),
                tokens[torch.from_numpy(rows).to(self.device)],
            )
        if raw_logprobs is None:
            return SampledBatch(tokens, None, column["logprobs"])
        return SampledBatch(tokens, pack_logprobs(raw_logprobs, tokens, column["logprobs"]),
                            column["logprobs"])  # fmt: skip

    def _slots_of(
        self,
        state: SlotParams,
        seqs: SequenceOf[SampledSequence],
        batch_rows: BatchRows | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each sequence's slot, whether it is new there, and its output position (what a
        seeded draw is keyed by). Rows of the persistent batch are read only when their
        generation changed; sequences past them (forked choices) one by one."""
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        given = 0
        if batch_rows is not None:
            rows, generations = batch_rows.rows, batch_rows.generations
            given = len(rows)
            joined = state.columns["generation"][rows] != generations
            for index in np.flatnonzero(joined):
                state.load(int(rows[index]), seqs[index])
            state.columns["generation"][rows] = generations
            parts.append((rows, joined, batch_rows.positions - state.columns["prompt"][rows]))
        if given < len(seqs):
            rest = seqs[given:]
            info = np.array(
                [(*state.slot_for(seq, rest), len(seq.token_ids) - seq.num_prompt_tokens)
                 for seq in rest],
                dtype=np.int64,
            ).reshape(-1, 3)  # fmt: skip
            parts.append((info[:, 0], info[:, 1].astype(bool), info[:, 2]))
        if len(parts) == 1:
            return parts[0]
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty.astype(bool), empty
        return tuple(np.concatenate(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]

    def _penalize(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[SampledSequence],
        slots: np.ndarray,
        joined: np.ndarray,
        column: dict[str, np.ndarray],
    ) -> torch.Tensor:
        state = self._slots
        assert state is not None
        rows = np.flatnonzero(column["penalized"])
        # Count rows only for penalized requests (a row per batch slot would cost
        # slots x vocab floats on the device as soon as one request asked).
        self._free_penalty_rows += state.released
        state.released.clear()
        for slot in slots[rows][state.penalty_row[slots[rows]] < 0]:
            if not self._free_penalty_rows:
                self._grow_penalties(logits.shape[1], logits.device)
            state.penalty_row[slot] = self._free_penalty_rows.pop()
        assert self._penalties is not None
        penalty_rows = state.penalty_row[slots]
        # A sequence new to the sampler brings its history once (a resumed request's
        # outputs, a recomputed one's); from then on each step adds its one token.
        for row in np.flatnonzero(column["penalized"] & joined):
            seq = seqs[row]
            self._penalties.reset_row(
                int(penalty_rows[row]),
                seq.token_ids[: seq.num_prompt_tokens],
                seq.token_ids[seq.num_prompt_tokens :],
            )

        def col(name: str, off: float) -> torch.Tensor | None:
            values = column[name][rows]
            if (values == off).all():
                return None
            return torch.from_numpy(values).to(logits.device)

        index = torch.from_numpy(rows).to(logits.device)
        logits = logits.clone()
        logits[index] = self._penalties.apply(
            logits[index],
            torch.from_numpy(penalty_rows[rows]).to(logits.device),
            col("presence", 0.0),
            col("frequency", 0.0),
            col("repetition", 1.0),
        )
        return logits

    def _grow_penalties(self, vocab: int, device: torch.device) -> None:
        old = 0 if self._penalties is None else self._penalties.counts.shape[0]
        grown = PenaltyCounts(max(8, 2 * old), vocab, device)
        if self._penalties is not None:
            grown.counts[:old], grown.seen[:old] = self._penalties.counts, self._penalties.seen
        self._penalties = grown
        self._free_penalty_rows += range(grown.counts.shape[0] - 1, old - 1, -1)

    def _add_bias(self, logits: torch.Tensor, rows: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        state = self._slots
        assert state is not None
        row_index: list[int] = []
        token_index: list[int] = []
        values: list[float] = []
        for row in rows:
            ids, bias = state.bias[int(slots[row])]
            row_index += [row] * len(ids)
            token_index += ids
            values += bias
        device = logits.device
        return logits.index_put(
            (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)),
            torch.tensor(values, device=device, dtype=logits.dtype),
            accumulate=True,
        )

    def _sample_random(
        self,
        logits: torch.Tensor,
        greedy_tokens: torch.Tensor | None,
        column: dict[str, np.ndarray],
        positions: np.ndarray,
    ) -> torch.Tensor:
        """Greedy rows keep their argmax; the others (only they) are tempered, filtered and
        drawn from."""
        device = logits.device
        random_rows = np.flatnonzero(~column["greedy"])
        index = torch.from_numpy(random_rows).to(device)
        subset = logits if greedy_tokens is None else logits.index_select(0, index)
        col = {name: values[random_rows] for name, values in column.items()}
        subset = subset / torch.from_numpy(col["temperature"]).to(device)[:, None]
        vocab = logits.shape[1]
        if (col["top_k"] < vocab).any() or (col["top_p"] < 1).any() or (col["min_p"] > 0).any():
            probs = filtered_probs(subset, col["top_k"], col["top_p"], col["min_p"])
        else:
            probs = torch.softmax(subset, dim=-1)
        # Seeded rows take their uniform from (seed, output position) alone, unseeded ones
        # from the engine's generator.
        uniforms = torch.rand(len(random_rows), generator=self.generator, device=device,
                              dtype=torch.float64)  # fmt: skip
        seeded = np.flatnonzero(col["seeded"])
        if len(seeded):
            uniforms[torch.from_numpy(seeded).to(device)] = counter_uniform(
                torch.from_numpy(col["seed"][seeded]).to(device),
                torch.from_numpy(positions[random_rows][seeded]).to(device),
            )
        sampled = sample_from_probs(probs, uniforms)
        if greedy_tokens is None:
            return sampled
        return greedy_tokens.index_copy(0, index, sampled)
