"""A prompt as the engine takes it: a string (tokenized with the checkpoint's tokenizer) or
token ids; a ValueError or TypeError says what is wrong, and the engine keeps nothing."""

from __future__ import annotations

from typing import Any


def prompt_token_ids(tokenizer: Any | None, prompt: Any) -> tuple[str | None, list[int]]:
    """(the prompt's text, or None when given as ids; its token ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass token ids")
        token_ids = list(tokenizer.encode(prompt))
        if not token_ids:
            raise ValueError("the prompt is empty after tokenization")
        return prompt, token_ids
    if isinstance(prompt, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if not prompt:
            raise ValueError("the prompt is empty")
        return None, list(prompt)
    raise TypeError("a prompt is a string or a list of token ids")
