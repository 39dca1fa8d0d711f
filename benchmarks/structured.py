"""Structured outputs: what a JSON-schema constraint costs a decode step, and compile times.

Run: .venv/bin/python benchmarks/structured.py [--threads 2] [--steps 20] [--batch 1 16 64]

On the default model (SmolLM2-135M-Instruct, Q4_1 GGUF; `LLM()`), per batch size:
the mean decode step time with every row unconstrained, and with every row
constrained by one JSON schema (each row's matcher fills its bitmask row, the
mask is applied, each accepted token advances the matcher). Only steps in which
all rows decode are timed. Then the grammar compile time per schema: cold (a
fresh compiler, xgrammar's own cache empty) and cached (the engine's LRU).
Prints one table and the machine and threads it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import time

from machine import machine_line

import kvserve.model.runner as runner_module
from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.state import GrammarState

SPENT = {"mask": 0.0, "advance": 0.0}
"""Seconds inside the grammar's own work: filling and applying the bitmask (runner), and
advancing the matchers (stop checker); timed by wrapping the two calls."""


def _timed(name: str, call):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0

    return wrapper


runner_module.apply_grammar = _timed("mask", runner_module.apply_grammar)
GrammarState.accept = _timed("advance", GrammarState.accept)

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "city": {"type": "string"},
                },
                "required": ["name", "age", "city"],
            },
        }
    },
    "required": ["people"],
}
SMALL = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string"}},
    "required": ["answer", "why"],
}
NESTED = {
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                    "minItems": 1,
                },
                "shipping": {"enum": ["standard", "express", "pickup"]},
                "notes": {"type": ["string", "null"]},
            },
            "required": ["id", "items", "shipping"],
        }
    },
    "required": ["order"],
}


def decode_step_times(
    llm: LLM, prompt: str, batch: int, steps: int, schema: dict | None
) -> tuple[list[float], list[float]]:
    """Seconds of each step in which all `batch` rows decode (prefill steps left out), and
    the seconds of each such step spent in the grammar's own work."""
    engine = llm.engine
    spec = None if schema is None else StructuredOutputsParams(json=schema)
    for i in range(batch):
        params = SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=steps + 8,
            ignore_eos=spec is None,
            structured_outputs=spec,
        )
        engine.add_request(f"r{i}", prompt, params)
    times, grammar = [], []
    while engine.has_unfinished_requests():
        before = SPENT["mask"] + SPENT["advance"]
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        decoding = engine.last_step_num_tokens == engine.last_step_num_chunks == batch
        if decoding and len(times) < steps:
            times.append(elapsed)
            grammar.append(SPENT["mask"] + SPENT["advance"] - before)
        elif len(times) >= steps or (engine.last_step_num_chunks < batch and times):
            break
    for i in range(batch):
        engine.abort_request(f"r{i}")
    return times, grammar


def compile_times(llm: LLM) -> list[tuple[str, float, float]]:
    tokenizer, runner = llm.engine.tokenizer, llm.engine.runner
    rows = []
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, runner.vocab_size, runner.eos_token_ids)
    compiler.compiler  # noqa: B018  (the tokenizer's vocabulary read once)
    rows.append(("tokenizer info (once per engine)", time.perf_counter() - t0, 0.0))
    specs = {
        "small (enum + string)": StructuredOutputsParams(json=SMALL),
        "people (array of objects)": StructuredOutputsParams(json=PEOPLE),
        "nested (pattern, number, enum)": StructuredOutputsParams(json=NESTED),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    for name, spec in specs.items():
        compiler.compiler.clear_cache()
        t0 = time.perf_counter()
        compiler.submit(spec).result()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.submit(spec).result()
        rows.append((name, cold, time.perf_counter() - t0))
    compiler.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeat", type=int, default=2, help="rounds; the best median counts")
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads, num_kv_blocks=4096)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three people as JSON: name, age and city."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    print(
        f"machine: {machine_line(args.threads)}; model: {llm.model.description}; "
        f"{args.steps} timed decode steps x {args.repeat} rounds (best median)"
    )
    print(
        f"{'batch':>5} {'plain ms/step':>14} {'json ms/step':>13} {'difference':>11} "
        f"{'grammar ms/step':>16} {'grammar share':>14}"
    )
    for batch in args.batch:
        decode_step_times(llm, prompt, batch, 3, PEOPLE)  # compile and warm up once
        p = c = g = float("inf")
        for _ in range(args.repeat):  # alternating, so both see the same machine
            plain, _ = decode_step_times(llm, prompt, batch, args.steps, None)
            constrained, grammar = decode_step_times(llm, prompt, batch, args.steps, PEOPLE)
            p = min(p, statistics.median(plain) * 1e3)
            c = min(c, statistics.median(constrained) * 1e3)
            g = min(g, statistics.median(grammar) * 1e3)
        note = "" if len(constrained) >= args.steps else f" ({len(constrained)} steps)"
        print(
            f"{batch:>5} {p:>14.2f} {c:>13.2f} {100 * (c - p) / p:>10.1f}% "
            f"{g:>16.3f} {100 * g / p:>13.1f}%{note}"
        )
    print()
    print(f"{'grammar compile':<34} {'cold ms':>9} {'cached ms':>10}")
    for name, cold, cached in compile_times(llm):
        print(f"{name:<34} {cold * 1e3:>9.2f} {cached * 1e3:>10.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
