"""The workloads and the load generator of benchmarks/serve.py (see its docstring).

Kept apart from the script so that what is measured (prompts, streaming,
timing, percentiles) reads on its own: this module knows nothing of how the
servers are started.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

SYSTEM = "You are a helpful assistant. Answer briefly."
# Words for English-like filler text: the prompts only need to be text of a
# known token length that a tokenizer splits as it splits prose.
_WORDS = (
    "the a an this that every each some many few most other such our their its "
    "system model engine cache block token request server client memory process thread "
    "queue table record answer question report river mountain city garden window letter "
    "morning evening winter summer history science music language market village road "
    "teacher student doctor farmer writer painter driver worker child family friend "
    "reads writes keeps moves builds finds shows holds opens closes follows carries "
    "measures changes explains describes remembers compares returns sends receives "
    "quickly slowly carefully often rarely always never again together almost nearly "
    "old new small large early late quiet bright simple careful useful common strange "
    "in on at by with from into over under after before between through across near"
)
WORDS = tuple(_WORDS.split())

Count = Callable[[str], int]
"""Prompt tokens of a text, as the server counts them."""


def english(rng: random.Random, tokens: int, count: Count) -> str:
    """Seeded English-like sentences of at most `tokens` tokens (and as many as fit)."""
    words: list[str] = []
    while count(_join(words)) < tokens:
        words += rng.sample(WORDS, rng.randint(6, 14))
        words[-1] += "."
    while words and count(_join(words)) > tokens:
        words.pop()
    return _join(words)


def _join(words: list[str]) -> str:
    out, capital = [], True
    for w in words:
        out.append(w.capitalize() if capital else w)
        capital = w.endswith(".")
    return " ".join(out)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat: the system prompt, then one user message per turn; each turn's prompt is the
    whole history (earlier messages and the model's answers) plus the new message."""

    system: str
    user_messages: tuple[str, ...]


Job = str | Conversation
"""One completion prompt, or one conversation (its turns are sequential)."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    jobs: list[Job]
    shape: str
    """Its sizes in words, for the table."""


def shared_prefix(
    seed: int, requests: int, prefix_tokens: int, suffix_tokens: int, count: Count
) -> Workload:
    """`requests` completion prompts: one long document (the shared prefix), then a distinct
    short question each."""
    rng = random.Random(f"shared-prefix-{seed}")
    prefix = "Read the document, then answer the question.\n\n" + english(rng, prefix_tokens, count)
    jobs: list[Job] = [
        f"{prefix}\n\nQuestion {i + 1}: {english(rng, suffix_tokens, count)}\nAnswer:"
        for i in range(requests)
    ]
    shape = f"prefix {count(prefix)} tokens + suffix about {suffix_tokens}"
    return Workload("shared-prefix", jobs, shape)


def multi_turn(
    seed: int, conversations: int, turns: int, first_tokens: int, turn_tokens: int, count: Count
) -> Workload:
    """`conversations` chats of `turns` turns: a long first message (each chat its own), short
    follow-ups; the model's answers become part of the history."""
    rng = random.Random(f"multi-turn-{seed}")
    jobs: list[Job] = []
    for _ in range(conversations):
        first = "Here are my notes:\n" + english(rng, first_tokens, count)
        rest = [english(rng, turn_tokens, count) for _ in range(turns - 1)]
        jobs.append(Conversation(SYSTEM, (first, *rest)))
    shape = (
        f"{turns} turns; first message about {first_tokens} tokens, then {turn_tokens} "
        "+ the previous answer"
    )
    return Workload("multi-turn", jobs, shape)


# -- one streamed request ----------------------------------------------------------


@dataclass(slots=True)
class Result:
    """What one streamed request measured."""

    ttft: float | None = None
    """Seconds from sending to the first chunk carrying text."""
    itls: list[float] = field(default_factory=list)
    """Gaps between consecutive chunks carrying text."""
    e2e: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    """usage.prompt_tokens_details.cached_tokens; None if the server gives no usage."""
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """A server to load: where, which model name, and what each request body adds
    (kvserve: ignore_eos; llama.cpp: a logit bias that bans end-of-sequence tokens)."""

    url: str
    model: str
    extra_body: dict[str, Any]
    prompt_tokens: Count | None = None
    """Counts prompt tokens when the server's stream carries no usage (llama.cpp)."""


async def stream(
    client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any]
) -> Result:
    """POST one streamed request and time its chunks."""
    body = {
        **body,
        **target.extra_body,
        "model": target.model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = Result()
    t0 = time.perf_counter()
    try:
        chunks = await _read(client, target.url + path, body, r, t0)
    except httpx.HTTPError as exc:  # a broken stream fails this request, not the run
        r.error = f"{type(exc).__name__}: {exc}"
        return r
    r.e2e = time.perf_counter() - t0
    if not r.prompt_tokens and target.prompt_tokens is not None:
        r.prompt_tokens = target.prompt_tokens(_prompt_text(body))
        # Without usage: one chunk per token (llama.cpp streams token by token), or all
        # max_tokens when the answer ran to its length.
        r.completion_tokens = body["max_tokens"] if r.finish_reason == "length" else chunks
    return r


async def _read(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], r: Result, t0: float
) -> int:
    """Stream the response into `r`; the number of chunks that carried text."""
    chunks, last = 0, t0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            r.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                r.error = str(chunk["error"].get("message"))
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece:
                    chunks += 1
                    r.text += piece
                    if r.ttft is None:
                        r.ttft = now - t0
                    else:
                        r.itls.append(now - last)
                    last = now
                r.finish_reason = choice.get("finish_reason") or r.finish_reason
            if usage := chunk.get("usage"):
                r.prompt_tokens = usage["prompt_tokens"]
                r.completion_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                r.cached_tokens = details.get("cached_tokens")
    return chunks


def _prompt_text(body: dict[str, Any]) -> str:
    if "prompt" in body:
        return body["prompt"]
    return "\n".join(m["content"] for m in body["messages"])


async def run_job(
    client: httpx.AsyncClient, target: Target, job: Job, max_tokens: int
) -> list[Result]:
    """A prompt's one request, or a conversation's turns one after the other."""
    params = {"max_tokens": max_tokens, "temperature": 0}
    if isinstance(job, str):
        return [await stream(client, target, "/v1/completions", {**params, "prompt": job})]
    messages = [{"role": "system", "content": job.system}]
    results = []
    for message in job.user_messages:
        messages.append({"role": "user", "content": message})
        r = await stream(client, target, "/v1/chat/completions", {**params, "messages": messages})
        results.append(r)
        if r.error:
            break
        messages = [*messages, {"role": "assistant", "content": r.text}]
    return results


@dataclass(slots=True)
class Run:
    """One workload against one target: every request's result (per job, per turn) and the
    wall time from the first request sent to the last one finished."""

    results: list[list[Result]]
    wall: float


async def run_workload(
    target: Target,
    workload: Workload,
    concurrency: int,
    max_tokens: int,
    request_rate: float,
    seed: int,
) -> Run:
    """Replay the workload: `concurrency` clients take jobs in order, each job no earlier
    than its arrival time (Poisson at `request_rate` per second; inf: all at once)."""
    rng = random.Random(f"arrivals-{seed}")
    arrivals, t = [], 0.0
    for _ in workload.jobs:
        arrivals.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    results: list[list[Result]] = [[] for _ in workload.jobs]
    next_job = iter(range(len(workload.jobs)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()

        async def client_loop() -> None:
            for i in next_job:
                delay = start + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                results[i] = await run_job(client, target, workload.jobs[i], max_tokens)

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return Run(results, wall)


async def run_rounds(target: Target, workload: Workload, max_tokens: int, seed: int) -> Run:
    """Replay a workload of conversations in rounds: every conversation's next turn at once,
    in a seeded shuffled order, the next round when all are answered (users who all reply
    after reading). Unlike run_workload's closed loop, no turn goes out the moment its
    previous answer frees a slot on the replica that gave it, where a router that chooses
    by load alone would send it back by chance."""
    chats = [job for job in workload.jobs if isinstance(job, Conversation)]
    if len(chats) != len(workload.jobs):
        raise ValueError(f"{workload.name}: rounds are for conversations only")
    rng = random.Random(f"rounds-{seed}")
    params = {"max_tokens": max_tokens, "temperature": 0}
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": c.system}] for c in chats
    ]
    results: list[list[Result]] = [[] for _ in chats]
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        start = time.perf_counter()
        for turn in range(max(len(c.user_messages) for c in chats)):
            order = [
                k for k, c in enumerate(chats)
                if turn < len(c.user_messages) and not any(r.error for r in results[k])
            ]  # fmt: skip
            rng.shuffle(order)
            for k in order:
                histories[k].append({"role": "user", "content": chats[k].user_messages[turn]})
            path = "/v1/chat/completions"
            answers = await asyncio.gather(
                *(stream(client, target, path, {**params, "messages": list(histories[k])})
                  for k in order)
            )  # fmt: skip
            for k, r in zip(order, answers, strict=True):
                results[k].append(r)
                histories[k].append({"role": "assistant", "content": r.text})
        wall = time.perf_counter() - start
    return Run(results, wall)


# -- figures -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Latency percentiles over all requests of all runs; tokens/s per run (median over runs
    and best); the cached share over all runs."""
    flat = [r for run in runs for job in run.results for r in job]
    ok = [r for r in flat if r.error is None]
    output_rates, total_rates = [], []
    for run in runs:
        done = [r for job in run.results for r in job if r.error is None]
        out = sum(r.completion_tokens for r in done)
        output_rates.append(out / run.wall)
        total_rates.append((out + sum(r.prompt_tokens for r in done)) / run.wall)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = [r.cached_tokens for r in ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    return {
        "requests": len(flat),
        "errors": len(flat) - len(ok),
        "first_error": next((r.error for r in flat if r.error), None),
        "prompt_tokens_mean": prompt / len(ok) if ok else 0.0,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(itls, 50),
        "itl_p99": percentile(itls, 99),
        "e2e_p50": percentile([r.e2e for r in ok], 50),
        "output_tps": percentile(output_rates, 50),
        "total_tps": percentile(total_rates, 50),
        "total_tps_best": max(total_rates, default=None),
        "cached_share": (
            sum(c for c in cached if c is not None) / prompt
            if prompt and all(c is not None for c in cached)
            else None
        ),
    }
