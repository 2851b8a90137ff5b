"""Tensor-parallel ranks on one machine (``tensor_parallel_size`` > 1).

Rank 0 is the engine core: it schedules, samples and talks to the world. It starts ranks
1..N-1 as processes; every rank loads its shard of the checkpoint
(``sluicegate.engine.parallel.shard``) and builds a model runner of its own, with a KV cache
of its own heads, and the ranks agree on the smallest block count any of them can hold. Then
rank 0 sends each step's inputs (token ids, positions, slots, block tables) before running
its forward; the others run the same forward on them, meeting rank 0 at every all-reduce and
at the logits' all-gather, and wait for the next. A rank that dies fails the step on rank 0
(``RankLost``): the engine fails the requests in flight and the worker exits for its
supervisor, as for any dead worker. Collectives use gloo on the CPU and NCCL on CUDA.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sluicegate.engine.options import EngineOptions, resolve_device
from sluicegate.engine.parallel.shard import TensorParallel
from sluicegate.engine.runner.attention import AttentionBackend, AttentionMetadata
from sluicegate.engine.runner.compilation import step_metadata

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""How long a rank waits for the others in one collective before failing (a backstop: a dead
rank's closed connection fails its peers at once)."""


class RankLost(RuntimeError):
    """A tensor-parallel rank exited: the engine cannot run another step."""


@dataclass
class StepInputs:
    """One forward's inputs, as rank 0 ran them (host tensors)."""

    ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_decodes: int | None
    sample_rows: torch.Tensor | None
    """Rows whose logits are computed (None: every row)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _threads_per_rank(options: EngineOptions, size: int) -> int:
    return options.num_threads or max(1, (os.cpu_count() or 1) // size)


def _join(rank: int, size: int, port: int, device: torch.device) -> dist.TCPStore:
    """A rank other than 0 joins the group rank 0 hosts."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(f"rank-{rank}", "up")
    _init_group(store, rank, size, device)
    return store


def _init_group(store: dist.TCPStore, rank: int, size: int, device: torch.device) -> None:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )


class RankGroup:
    """Rank 0's handle on the others."""

    def __init__(self, model: Path, options: EngineOptions) -> None:
        size = options.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("one tensor-parallel engine per process: a process group exists")
        device = resolve_device(options.device)
        if device.type == "cpu":
            torch.set_num_threads(_threads_per_rank(options, size))
        port = _free_port()
        context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        for rank in range(1, size):
            process = context.Process(
                target=follow,
                args=(rank, size, port, str(model), options),
                name=f"sluicegate-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)
        self._host(port, size, device)
        self.size = size
        self._closed = False
        logger.info("tensor parallelism: %d ranks (%s)", size, dist.get_backend())

    def _host(self, port: int, size: int, device: torch.device) -> None:
        """Rank 0's side of the rendezvous: wait for the others to come up (they load torch
        first), failing as soon as one of them exits instead of at the store's timeout."""
        store = dist.TCPStore(
            "127.0.0.1", port, size, is_master=True, wait_for_workers=False,
            timeout=COLLECTIVE_TIMEOUT,
        )  # fmt: skip
        keys = [f"rank-{rank}" for rank in range(1, size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise RankLost("tensor-parallel ranks did not start in time")
            time.sleep(0.05)
        _init_group(store, 0, size, device)
        self._store = store

    def check(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RankLost(
                    f"tensor-parallel rank {rank} exited (code {process.exitcode}): "
                    "the engine stops"
                )

    def send(self, command: tuple[Any, ...]) -> None:
        """Broadcast one command to ranks 1..N-1 (a step, a block copy, stop)."""
        self.check()
        try:
            dist.broadcast_object_list([command], src=0)
        except RuntimeError as exc:
            # A killed rank's sockets close while it is still being torn down: give it a
            # moment to be reaped, so the error names it.
            for process in self.processes:
                process.join(timeout=2)
            self.check()
            raise RankLost(f"tensor-parallel collective failed: {exc}") from exc

    def send_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor | None,
    ) -> None:
        """This forward's inputs, before rank 0 runs it (``sample_rows`` None: every row's
        logits)."""
        inputs = StepInputs(
            ids=ids.cpu(),
            positions=positions.cpu(),
            slot_mapping=meta.slot_mapping.cpu(),
            block_tables=meta.block_tables.cpu(),
            seq_lens=meta.seq_lens.cpu(),
            cu_seqlens_q=meta.cu_seqlens_q.cpu(),
            num_decodes=meta.num_decodes,
            sample_rows=None if sample_rows is None else sample_rows.cpu(),
        )
        self.send(("step", inputs))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([("stop",)], src=0)
        except RuntimeError:
            logger.warning("tensor-parallel ranks did not take the stop command")
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        dist.destroy_process_group()


def agree_on_blocks(num_blocks: int) -> int:
    """The fewest KV blocks any rank can hold (their heads, and so bytes per block, differ)."""
    count = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


def follow(rank: int, size: int, port: int, model: str, options: EngineOptions) -> None:
    """A rank other than 0: load its shard, build its runner, then run the steps rank 0
    sends until told to stop (or until rank 0 is gone)."""
    from sluicegate.engine.models.loader import shard_plan
    from sluicegate.engine.runner.build import build_runner, context_length, load_engine_model

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(message)s")
    device = resolve_device(options.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(_threads_per_rank(options, size))
    _join(rank, size, port, device)
    try:
        tp = TensorParallel(shard_plan(Path(model), rank, size))
        loaded, _ = load_engine_model(model, device, options, tp)
        runner = build_runner(loaded, device, options, context_length(loaded, options))
        runner.resize_kv_cache(agree_on_blocks(runner.num_kv_blocks))
        forward = runner.model
        while True:
            command: list[Any] = [None]
            dist.broadcast_object_list(command, src=0)
            kind, *args = command[0]
            if kind == "stop":
                break
            if kind == "step":
                follow_step(forward, runner.backend, device, args[0])
            elif kind == "copy":
                runner.copy_blocks(args[0])
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
    finally:
        dist.destroy_process_group()


@torch.inference_mode()
def follow_step(
    model: Any, backend: AttentionBackend, device: torch.device, inputs: StepInputs
) -> None:
    """Rank 0's forward and logits, on this rank's shard of ``model`` (the logits stay with
    rank 0)."""
    meta = AttentionMetadata(
        backend=backend,
        slot_mapping=inputs.slot_mapping.to(device),
        block_tables=inputs.block_tables.to(device),
        seq_lens=inputs.seq_lens.to(device),
        cu_seqlens_q=inputs.cu_seqlens_q.to(device),
        num_decodes=inputs.num_decodes,
    )
    with step_metadata(meta):
        hidden = model(inputs.ids.to(device), inputs.positions.to(device), meta)
    if inputs.sample_rows is not None:
        hidden = hidden[inputs.sample_rows.to(device)]
    model.compute_logits(hidden)
