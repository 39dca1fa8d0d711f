"""A multi-turn chat workload through the official `openai` client (greedy, so repeatable)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai

OPENERS = ("Alpha tells", "Bravo asks", "Charlie sings", "Delta writes", "Echo draws", "Fox runs")
FOLLOW_UPS = ("And then?", "Why so?", "Tell me more.", "Finish it.")


def client(url: str) -> openai.OpenAI:
    """No retries of its own: a request the router loses must show up as an error."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def ask(c: openai.OpenAI, model: str, messages: list, salt: str, stream: bool) -> tuple[str, int]:
    """(answer, cached_tokens); streamed answers ask for the usage chunk."""
    kwargs = {
        "model": model,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"cache_salt": salt},
    }
    if not stream:
        out = c.chat.completions.create(**kwargs)
        return out.choices[0].message.content or "", out.usage.prompt_tokens_details.cached_tokens
    chunks = list(
        c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks[-1].usage.prompt_tokens_details.cached_tokens


def conversations(
    url: str,
    model: str,
    salt: str,
    n: int = 4,
    turns: int = 3,
    before_turn: Callable[[int], None] | None = None,
) -> list[int]:
    """n conversations, turn by turn; every answer's cached tokens, in order.

    A turn's n requests are sent at once (so a load-aware policy spreads the
    first turn), the next turn when all are answered. Each conversation has
    its own cache salt, so conversations share no block and each one's hits
    come from its own earlier turns; odd ones are streamed.
    """
    chats = [[{"role": "user", "content": f"{OPENERS[k]} a story {k}."}] for k in range(n)]
    cached = []
    with client(url) as c, ThreadPoolExecutor(n) as pool:
        for turn in range(turns):
            if before_turn is not None:
                before_turn(turn)
            answers = pool.map(
                lambda k: ask(c, model, chats[k], f"{salt}-{k}", stream=k % 2 == 1), range(n)
            )
            for chat, (text, hit) in zip(chats, list(answers), strict=True):
                chat += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
                ]
                cached.append(hit)
    return cached
