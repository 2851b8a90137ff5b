"""Output tokens/s of the engine with and without json_schema-constrained decoding (issue 9,
acceptance 4), on this CPU, side by side in one run.

A random Llama (4 layers, hidden 512, float32) with a byte-level BPE tokenizer (the kind
xgrammar must handle: JSON punctuation, multi-byte characters split across tokens) serves the
same seeded workload of 64 chat requests twice, all submitted at once to ``LLM.chat``:

- constrained: ``response_format`` json_schema (nested object, enums, bounded strings, an array,
  ``additionalProperties: false``), sampled at temperature 1 with a seed per request; each
  output must parse and validate against the schema (``valid_fraction``);
- free: the same prompts and sampling, unconstrained, each request generating exactly as many
  tokens as its constrained twin did (``ignore_eos``), so both runs do the same model work.

The schema is compiled once before timing (the grammar cache), as a server that has seen it.
The constrained run is timed twice, before and after the free one (seeded: the same outputs),
and its mean is reported, so neither side gains from running first or last on a busy machine.
The last line is one JSON object: free_tok_s, constrained_tok_s, ratio (constrained / free),
valid_fraction; the target is ratio >= 0.85 and valid_fraction == 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# bench/kernels.py would shadow the `kernels` package the engine imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import jsonschema  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sluicegate.engine import LLM, SamplingParams  # noqa: E402
from sluicegate.engine.demo_model import _build_tokenizer  # noqa: E402
from sluicegate.engine.protocol import Structured  # noqa: E402
from sluicegate.engine.serving.request_options import RequestOptions  # noqa: E402

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": NAME,
        "kind": {"enum": ["river", "gate", "lock", "weir"]},
        "open": {"type": "boolean"},
        "keeper": {
            "type": "object",
            "properties": {"name": NAME, "level": {"enum": [1, 2, 3]}},
            "required": ["name", "level"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "open", "keeper", "tags"],
    "additionalProperties": False,
}
TOPICS = ["a river", "a gate", "the water", "a lock keeper", "the night shift", "a flood"]


def build_model(folder: Path, layers: int) -> None:
    tokenizer = _build_tokenizer(512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def conversations(num_requests: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON, case {i}."}]
        for i in range(num_requests)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads"
    )
    args = parser.parse_args()
    chats = conversations(args.requests)
    constrained = RequestOptions(
        structured=Structured("json_schema", json_schema=json.dumps(SCHEMA), strict=True)
    )
    sampled = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i)
        for i in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, args.layers)
        llm = LLM(str(folder), dtype="float32", device="cpu", num_threads=args.threads)
        llm.chat(chats[:2], SamplingParams(max_tokens=4), constrained)  # compile + warm up

        start = time.perf_counter()
        outputs = llm.chat(chats, sampled, constrained)
        constrained_s = time.perf_counter() - start
        lengths = [len(o.token_ids) for o in outputs]
        valid = 0
        for output in outputs:
            try:
                jsonschema.validate(json.loads(output.text), SCHEMA)
                valid += output.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass

        free_params = [
            SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        start = time.perf_counter()
        free = llm.chat(chats, free_params)
        free_s = time.perf_counter() - start
        assert [len(o.token_ids) for o in free] == lengths, "free run produced other lengths"

        start = time.perf_counter()
        again = llm.chat(chats, sampled, constrained)
        constrained_s = (constrained_s + time.perf_counter() - start) / 2
        assert [o.text for o in again] == [o.text for o in outputs], "seeded runs differ"

    produced = sum(lengths)
    free_tok_s, constrained_tok_s = produced / free_s, produced / constrained_s
    print(
        f"{args.requests} requests, {produced} output tokens (mean {produced / len(lengths):.0f}),"
        f" torch threads {torch.get_num_threads()}"
    )
    print(f"free:        {free_tok_s:8.1f} output tok/s")
    print(f"constrained: {constrained_tok_s:8.1f} output tok/s, {valid}/{len(outputs)} valid")
    print(
        json.dumps(
            {
                "free_tok_s": round(free_tok_s, 1),
                "constrained_tok_s": round(constrained_tok_s, 1),
                "ratio": round(constrained_tok_s / free_tok_s, 3),
                "valid_fraction": valid / len(outputs),
            }
        )
    )


if __name__ == "__main__":
    main()
