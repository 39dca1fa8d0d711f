"""OpenAI's `prompt` field read one way, by the server and by the router that predicts its hits.

A string, a list of token ids, or a non-empty list of either (a batch). A
ValueError says what is wrong (the server answers it as a 400 naming `prompt`;
the router forwards the body without a prediction).
"""

from __future__ import annotations

from typing import Any


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    if is_token_ids(prompt) or isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        prompts = prompt
    else:
        raise ValueError("prompt must be a string, a list of token ids, or a list of either")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) and p) and not is_token_ids(p):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ValueError(f"{where} must be a non-empty string or list of token ids")
    return prompts


def is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
