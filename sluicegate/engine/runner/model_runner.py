"""Owns the model and its paged KV cache on one device; runs one scheduler step at a time."""

from __future__ import annotations

import logging

import numpy as np
import torch

from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.core.scheduler_output import SchedulerOutput
from sluicegate.engine.lora import LoraManager
from sluicegate.engine.models.llama import LlamaForCausalLM
from sluicegate.engine.runner.attention import AttentionMetadata, load_backend
from sluicegate.engine.runner.compilation import compile_model as compile_model_forward
from sluicegate.engine.runner.compilation import register_layers, step_metadata, warm_compiled
from sluicegate.engine.runner.cuda_graphs import DecodeGraphs
from sluicegate.engine.runner.hooks import KVMirror, StepFollowers
from sluicegate.engine.runner.input_batch import InputBatch, StepArrays
from sluicegate.engine.runner.kv_cache import allocate_kv_cache, cpu_num_blocks, kv_bytes_per_block
from sluicegate.engine.runner.staging import PinnedStaging
from sluicegate.kernels.reference import FP8_DTYPES

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str | None = None,
        compile_model: bool = False,
        cuda_graphs: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
        loras: LoraManager | None = None,
    ) -> None:
        self.model = model
        self.loras = loras
        self.config = model.config
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype or model.config.dtype
        if self.kv_cache_dtype in FP8_DTYPES and device.type == "cuda":
            # The Triton kernels read a cache of the model's dtype; the reference reads any.
            attention_backend = "torch"
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.backend = load_backend(attention_backend, device)
        self._forward = model.forward
        self.last_step: StepArrays | None = None
        self._pending_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.mirror: KVMirror | None = None
        self.ranks: StepFollowers | None = None
        """Tensor parallelism, on rank 0: the other ranks, sent every step before it runs."""
        self.num_kv_blocks = self._plan_num_blocks(
            num_kv_blocks, kv_cache_memory, gpu_memory_utilization
        )
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens in %s, %.0f MiB",
            self.num_kv_blocks,
            block_size,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.num_kv_blocks * self.kv_bytes_per_block / 2**20,
        )
        self.input_batch = InputBatch(
            max_num_seqs, max_model_len, block_size, max_num_batched_tokens
        )
        if device.type != "cpu":
            # Ids, positions, slots and (a speculative step's: one per verified token)
            # sampled rows per token; lengths, query offsets and sampled rows per request.
            capacity = (
                4 * max_num_batched_tokens
                + 3 * max_num_seqs
                + 1
                + max_num_seqs * self.input_batch.max_blocks
            )
            self._staging = PinnedStaging(capacity)
            self._device_staging = torch.empty(capacity, dtype=torch.int32, device=device)
        if device.type == "cuda" and self.backend.name == "triton":
            self._warm_up_kernels()
        if compile_model:
            # One eager step first: modules that set up lazily (the rotary frequencies'
            # device copy) must not change state inside the compiled function.
            self._dummy_step(1, 1)
            self._forward = compile_model_forward(model)
        if compile_model or device.type == "cuda":
            # Compilation, and on CUDA every Triton variant a step can meet, at start-up
            # rather than mid-serving.
            warm_compiled(self._dummy_step, self._compile_shapes())
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            register_layers(model)
            self.graphs = DecodeGraphs(
                self._forward,
                model.compute_logits,
                self.backend,
                device,
                max_num_seqs,
                self.input_batch.max_blocks,
            )
            self.graphs.capture()

    def resize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks != self.num_kv_blocks:
            logger.info("KV cache: %d blocks, as every tensor-parallel rank holds", num_blocks)
            self.num_kv_blocks = num_blocks
            self.kv_cache = self._allocate_kv_cache(num_blocks)

    def attach_draft(self, mirror: KVMirror) -> None:
        """From now on every step also runs ``mirror`` on its inputs. Steps then run eagerly:
        a captured CUDA graph would replay the target alone."""
        self.mirror = mirror
        self.graphs = None

    def _warm_up_kernels(self) -> None:
        """Every Triton attention variant this model can launch (decode, prefill, each
        split-KV count) compiled now, not mid-serving; the model's dummy steps below
        cover the rest (KV store, compiled code)."""
        from sluicegate.kernels.triton_paged_attention import warm_up

        c = self.config
        names = warm_up(
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            block_size=self.block_size,
            dtype=c.dtype,
            device=self.device,
            max_num_seqs=self.max_num_seqs,
            max_blocks=self.input_batch.max_blocks,
        )
        logger.info("Triton attention variants compiled at start-up: %s", ", ".join(names))

    # -- KV cache ---------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.kv_cache_dtype, self.block_size)

    def _plan_num_blocks(
        self, num_kv_blocks: int | None, kv_cache_memory: int | None, utilization: float
    ) -> int:
        if num_kv_blocks is not None:
            return num_kv_blocks
        if kv_cache_memory is None and self.device.type == "cuda":
            return self._blocks_from_free_gpu_memory(utilization)
        return cpu_num_blocks(
            kv_cache_memory,
            self.kv_bytes_per_block,
            self.max_num_seqs,
            self.max_model_len,
            self.block_size,
        )

    def _blocks_from_free_gpu_memory(self, utilization: float) -> int:
        """Run the largest step the scheduler can form, then give the cache whatever of
        ``utilization`` x total memory is left beyond weights and peak activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        warmup_blocks = self.max_num_seqs + blocks_for(self.max_num_batched_tokens, self.block_size)
        self.kv_cache = self._allocate_kv_cache(warmup_blocks)
        cache_bytes = warmup_blocks * self.kv_bytes_per_block
        self._warmup()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        del self.kv_cache
        torch.cuda.empty_cache()
        used_by_others = total - free - current
        # Weights stay resident; activations peak at (peak - current); the warm-up cache goes.
        available = total * utilization - used_by_others - peak + cache_bytes
        blocks = int(available) // self.kv_bytes_per_block
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}"
            )
        logger.info("KV cache: %d blocks (peak activations %.2f GiB)", blocks, peak / 2**30)
        return blocks

    def _warmup(self) -> None:
        num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)
        self._dummy_step(num_seqs, self.max_num_batched_tokens // num_seqs)
        torch.cuda.synchronize(self.device)

    def _compile_shapes(self) -> list[tuple[int, int]]:
        """(requests, tokens each) that reach every specialisation: decode of 1 and of
        several requests, a prefill, and a batch as large as one step can be."""
        most = min(self.max_num_seqs, self.max_num_batched_tokens)
        return [(1, 1), (min(2, most), 1), (1, min(16, self.max_num_batched_tokens)), (most, 1)]

    @torch.inference_mode()
    def _dummy_step(self, num_seqs: int, tokens_each: int) -> None:
        """A forward and LM head over ``num_seqs`` fresh requests of ``tokens_each`` tokens
        (start-up only: sizes memory, triggers compilation)."""
        lengths = [tokens_each] * num_seqs
        tokens = sum(lengths)
        slots, tables, next_block = [], [], 0
        for length in lengths:
            table = [
                b % self.num_kv_blocks_allocated
                for b in range(next_block, next_block + blocks_for(length, self.block_size))
            ]
            next_block += len(table)
            tables.append(table)
            slots.extend(
                table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(length)
            )
        positions = [p for length in lengths for p in range(length)]
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        meta = self._metadata(slots, tables, lengths, cu)
        ids = torch.zeros(tokens, dtype=torch.int32, device=self.device)
        with step_metadata(meta):
            hidden = self._forward(
                ids, torch.tensor(positions, dtype=torch.int32, device=self.device), meta
            )
        self.model.compute_logits(hidden[torch.tensor(cu[1:], device=self.device) - 1])

    @property
    def num_kv_blocks_allocated(self) -> int:
        return self.kv_cache.shape[2]

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return allocate_kv_cache(
            self.model, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, K and V): a forked choice's own last block."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        if self.ranks is not None:
            self.ranks.send(("copy", copies))
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        if self.mirror is not None:
            self.mirror.copy_blocks(src, dst)

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> torch.Tensor:
        """Forward this step's tokens; logits (float32) only for the scheduled items that
        sample, in their order in ``output.scheduled``."""
        step = self.input_batch.prepare(output)
        self.last_step = step
        # A step with LoRA adapters runs eager: the graphs and compiled forward know none.
        eager = self.loras is not None and self.loras.begin_step(output.scheduled)
        graphs = None if eager else self.graphs
        if graphs is not None and (size := graphs.padded_size(step)) is not None:
            return graphs.replay(step, size, self._fill_pending).float()
        ids, positions, meta, sample_rows = self._device_inputs(step)
        self._fill_pending(ids, step)
        samples_some = len(step.sample_rows) != len(step.input_ids)
        if self.ranks is not None:
            self.ranks.send_step(ids, positions, meta, sample_rows if samples_some else None)
        with step_metadata(meta):
            hidden = (self.model.forward if eager else self._forward)(ids, positions, meta)
        if self.mirror is not None:
            self.mirror.mirror(ids, positions, meta)
        if samples_some:
            hidden = hidden[sample_rows]
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def run_speculative(self, output: SchedulerOutput, num_drafts: np.ndarray) -> torch.Tensor:
        """As ``run``, but the i-th sampling item's logits come at each of its last
        ``num_drafts[i] + 1`` positions (the draft tokens it verifies, then its next token),
        item after item. Eager: a step of several query tokens per row replays no graph."""
        step = self.input_batch.prepare(output)
        self.last_step = step
        last = step.sample_rows.astype(np.int64)
        widths = num_drafts + 1
        offsets = np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
        step.sample_rows = (np.repeat(last - num_drafts, widths) + offsets).astype(np.int32)
        ids, positions, meta, sample_rows = self._device_inputs(step)
        eager = self.loras is not None and self.loras.begin_step(output.scheduled)
        if self.ranks is not None:
            self.ranks.send_step(ids, positions, meta, sample_rows)
        with step_metadata(meta):
            hidden = (self.model.forward if eager else self._forward)(ids, positions, meta)
        if self.mirror is not None:
            self.mirror.mirror(ids, positions, meta)
        return self.model.compute_logits(hidden[sample_rows]).float()

    def rollback(self, row: int, generation: int, num_tokens: int, num_blocks: int) -> None:
        """A request's batch row after rejected draft tokens: its known tokens and its
        block table end where the scheduler's rollback left the sequence."""
        self.input_batch.rollback(row, generation, num_tokens, num_blocks)

    def mark_pending(self, step: StepArrays, tokens: torch.Tensor) -> None:
        """``step``'s sampled tokens, on the device and not read yet: the next step takes
        its decode inputs from them there (async scheduling)."""
        self.input_batch.mark_pending(step)
        self._pending_tokens = tokens

    def record_sampled(self, step: StepArrays, token_ids: list[int]) -> None:
        """``step``'s sampled tokens, read back, in order."""
        self.input_batch.record_sampled(step, token_ids)

    def _fill_pending(self, ids: torch.Tensor, step: StepArrays) -> None:
        """Input ids the host does not know yet, copied on the device from the sampled
        tokens of the step still in flight."""
        if not len(step.pending_index):
            return
        index = torch.from_numpy(step.pending_index).to(self.device, non_blocking=True)
        source = torch.from_numpy(step.pending_source).to(self.device, non_blocking=True)
        ids[index] = self._pending_tokens[source].to(ids.dtype)

    def _device_inputs(
        self, step: StepArrays
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        parts = (
            step.input_ids,
            step.positions,
            step.slot_mapping,
            step.seq_lens,
            step.cu_seqlens_q,
            step.sample_rows,
        )
        if self.device.type == "cpu":
            ids, positions, slots, seq_lens, cu, sample_rows = (torch.from_numpy(p) for p in parts)
            tables = torch.from_numpy(step.block_tables)
        else:
            # One host-to-device copy from pinned memory for all of the step's inputs (the
            # pinned buffers alternate, so preparing the next step never overwrites one whose
            # copy is still queued: see sluicegate.engine.runner.staging).
            flat = (*parts, step.block_tables.reshape(-1))
            sizes = [p.size for p in flat]
            total = sum(sizes)
            np.concatenate(flat, out=self._staging.acquire()[:total])
            self._staging.copy_to(self._device_staging, total)
            device_flat = self._device_staging[:total]
            ids, positions, slots, seq_lens, cu, sample_rows, tables = device_flat.split(sizes)
            tables = tables.view(step.block_tables.shape)
        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            cu_seqlens_q=cu,
            num_decodes=step.num_decodes,
        )
        return ids, positions, meta, sample_rows

    def _metadata(
        self,
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
        cu_seqlens: list[int],
    ) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        # Past a request's last block the table is never read; 0 keeps any stray read in bounds.
        padded = [t + [0] * (width - len(t)) for t in tables]

        def int32(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)

        return AttentionMetadata(
            backend=self.backend,
            slot_mapping=int32(slots),
            block_tables=int32(padded),
            seq_lens=int32(seq_lens),
            cu_seqlens_q=int32(cu_seqlens),
        )
