"""``sluicegate engine`` / ``python -m sluicegate.engine.worker``: the command line, start-up (metrics
endpoint, engine, Redis connections) and signal handling around one ``Worker``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from typing import Any

from redis.exceptions import RedisError

from sluicegate.engine.redis_client import async_client, pubsub_client
from sluicegate.engine.served_names import default_served_name
from sluicegate.engine.spec.config import SpeculativeConfig
from sluicegate.engine.worker.lifecycle import Worker
from sluicegate.engine.worker.metrics import HealthServer, WorkerMetrics
from sluicegate.engine.worker.options import Backoff, WorkerOptions

logger = logging.getLogger("sluicegate.worker")


def _log_tasks() -> None:
    """SIGUSR1: log where every asyncio task of the worker is waiting (for a stuck worker)."""
    import io

    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(limit=6, file=out)
        logger.warning("task %s:\n%s", task.get_name(), out.getvalue())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluicegate engine", description="run an engine worker fed over Redis Streams"
    )
    parser.add_argument(
        "--model", required=True, help="local Hugging Face model folder, or a GGUF file"
    )
    parser.add_argument(
        "--served-model-name",
        help="model name clients use (default: the folder's name, a GGUF file's without .gguf)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLUICEGATE_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    parser.add_argument("--worker-id", help="consumer name in the group (default: host-pid)")
    parser.add_argument("--metrics-port", type=int, default=9100, help="0 picks a free port")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--heartbeat-ttl", type=float, default=3.0)
    parser.add_argument("--claim-idle", type=float, default=3.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--max-pull", type=int, default=16)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--num-kv-blocks", type=int)
    engine.add_argument("--kv-cache-memory", type=int, help="bytes for the KV cache on CPU")
    engine.add_argument("--max-num-seqs", type=int)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--gpu-memory-utilization", type=float)
    engine.add_argument("--dtype")
    engine.add_argument("--device")
    engine.add_argument("--num-threads", type=int, help="CPU threads for the model (CPU only)")
    engine.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"),
        help="the KV cache's dtype (default auto: the model's); fp8 holds twice bf16's tokens",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="split the model over this many ranks (processes: one per GPU on CUDA, gloo on "
        "the CPU); default 1",
    )
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--model-impl",
        choices=("auto", "native", "transformers"),
        help="native code or the checkpoint's transformers class on our paged attention "
        "(default auto: native for Llama, Mistral, Qwen2, Qwen3, else transformers)",
    )
    engine.add_argument(
        "--tool-parser",
        help="tool-call format: hermes or llama3_json (default: detected from the chat template)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile and no CUDA graphs (both are on by default on CUDA)",
    )
    engine.add_argument("--cpu-compile", action="store_true", help="torch.compile on CPU too")
    engine.add_argument(
        "--cpu-linears",
        choices=("auto", "packed", "onednn", "pairs", "torch"),
        help="CPU linears: our packed product, oneDNN with the weight packed once (float32; "
        "bfloat16 where this CPU has the instructions), pairs (bfloat16 models on AVX512_BF16 "
        "CPUs: the layers through our bfloat16 dot-product kernel) or aten (default auto: "
        "the fastest, raced at start-up on the model's weights)",
    )
    engine.add_argument(
        "--core-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the engine core (scheduler, model, sampling, detokenizing) in a process of "
        "its own, so Redis I/O and tokenizing here run in parallel with its steps (default: "
        "off; on this project's 2-core CPU machine it measured no faster, see bench/e2e.py)",
    )
    engine.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish the prefix cache's changes on Redis so gateways route requests to the "
        "worker holding their prefix (docs/kv-events.md; default: on)",
    )
    engine.add_argument(
        "--speculative-config",
        type=_speculative_config,
        help='speculative decoding as vLLM spells it, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        "(default: off)",
    )
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        metavar="NAME=PATH",
        help="peft adapter folders to load at start-up (more load at run time: a request's "
        "adapter on first use, or a LoadLora command); implies --max-loras 1 if not given",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        help="distinct adapters one step can mix (device slots); 0 (default): LoRA off",
    )
    lora.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 16)")
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        help="adapters held in host memory, least recently used dropped (default: --max-loras)",
    )
    engine.add_argument("--log-level", default=os.environ.get("SLUICEGATE_LOG_LEVEL", "INFO"))
    return parser


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH")
    return name, path


def _speculative_config(text: str) -> dict[str, Any]:
    """The flag's JSON, checked at parse time so a typo fails before the model loads."""
    try:
        return dataclasses.asdict(SpeculativeConfig.parse(text))
    except ValueError as exc:  # json.JSONDecodeError included
        raise argparse.ArgumentTypeError(str(exc)) from exc


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "gpu_memory_utilization",
        "dtype",
        "device",
        "num_threads",
        "model_impl",
        "tool_parser",
        "cpu_linears",
        "speculative_config",
        "tensor_parallel_size",
        "kv_cache_dtype",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
    )
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.lora_modules:
        kwargs["lora_modules"] = dict(args.lora_modules)
        kwargs.setdefault("max_loras", 1)
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.cpu_compile:
        kwargs["cpu_compile"] = True
    if args.kv_events and not args.no_prefix_caching:
        kwargs["kv_events"] = True
    return kwargs


async def serve(args: argparse.Namespace) -> int:
    served_name: str = args.served_model_name
    options = WorkerOptions(
        model_name=served_name,
        redis_url=args.redis_url,
        heartbeat_ttl_s=args.heartbeat_ttl,
        claim_idle_s=args.claim_idle,
        drain_timeout_s=args.drain_timeout,
        max_pull=args.max_pull,
    )
    if args.worker_id:
        options.worker_id = args.worker_id
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _log_tasks)

    metrics = WorkerMetrics(served_name)
    health = HealthServer(metrics, args.metrics_host, args.metrics_port)
    await health.start()
    logger.info("worker %s: metrics on port %d", options.worker_id, health.port)

    from sluicegate.engine.serving.async_engine import AsyncEngine

    logger.info("loading %s as %r", args.model, served_name)
    engine = AsyncEngine(args.model, core_process=args.core_process, **engine_kwargs(args))
    await engine.start()
    # A dead engine core fails what was in flight; then the worker stops, non-zero, so its
    # supervisor starts a fresh one.
    core_watch = asyncio.create_task(_stop_when(engine.failed, stop), name="core-watch")
    redis = async_client(args.redis_url, socket_connect_timeout=2.0, health_check_interval=10)
    cancels = pubsub_client(args.redis_url, socket_connect_timeout=2.0, health_check_interval=10)
    worker = Worker(engine, redis, options, metrics, pubsub_redis=cancels)
    health.refresh = lambda: metrics.observe_engine_stats(engine.stats())
    try:
        backoff = Backoff()
        while not stop.is_set():
            try:
                await worker.ensure_groups()
                break
            except (RedisError, OSError) as exc:
                await backoff.wait("startup", exc)
        health.ready = True
        logger.info("worker %s ready, serving %r", options.worker_id, served_name)
        if not stop.is_set():
            await worker.run(stop)
    finally:
        core_watch.cancel()
        health.ready = False
        await engine.shutdown()
        await redis.aclose()
        await cancels.aclose()
        await health.stop()
    if engine.failed.is_set():
        logger.error("worker %s stopped: its engine core process died", options.worker_id)
        return 1
    logger.info("worker %s stopped", options.worker_id)
    return 0


async def _stop_when(event: asyncio.Event, stop: asyncio.Event) -> None:
    await event.wait()
    stop.set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.served_model_name = args.served_model_name or default_served_name(args.model)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
