"""The server's tokenizer work on its own thread: off the engine thread and off the event loop.

A prompt is tokenized (a conversation rendered through the chat template, ids
decoded for /detokenize and echo) on one worker thread, so a big prompt stalls
neither the steps of the requests running nor the loop that serves the others;
the engine is handed token ids. One thread, so calls never overlap on the
tokenizer (the engine thread only decodes, which changes no tokenizer state).

Before any work, a prompt string is checked against the longest prompt that
could fit: `max_model_len` tokens of at most `chars_per_token` characters each
(twice the checkpoint's longest token, at least 32); a longer one is refused
without being tokenized (kvserve.request_limits: the router checks the same, with
the `limits` this replica's /kv-metadata reports).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvserve.request_limits import MIN_CHARS_PER_TOKEN, LimitError, PromptLimits, check_prompt_chars
from kvserve.request_limits import max_prompt_chars as longest_prompt
from kvserve.serve.http.errors import APIError, refusal

T = TypeVar("T")


class TokenizerWorker:
    def __init__(self, tokenizer: Any | None, max_model_len: int | None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size: int | None = None
        self.chars_per_token = MIN_CHARS_PER_TOKEN
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
            self.vocab_size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
            longest = max((len(token) for token in vocab), default=0)
            self.chars_per_token = max(MIN_CHARS_PER_TOKEN, 2 * longest)
        self._reads: dict[str, bool] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest prompt string that could fit in max_model_len tokens (None: any)."""
        return longest_prompt(self.max_model_len, self.chars_per_token)

    def prompt_limits(self, max_n: int | None, max_tools: int | None) -> PromptLimits:
        """What /kv-metadata reports, so a router refuses what this replica would."""
        return PromptLimits(
            self.max_model_len,
            self.chars_per_token,
            max_n,
            max_tools,
            self.template_reads("tools"),
        )

    def check_length(self, num_chars: int, param: str) -> None:
        """A 400 for text longer than any prompt that fits, before it is tokenized."""
        try:
            check_prompt_chars(num_chars, self.max_model_len, self.chars_per_token, param)
        except LimitError as exc:
            raise refusal(exc) from None

    def checked_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError("this checkpoint has no tokenizer: send token ids")
        return self.tokenizer

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn` on the worker thread; its result (or its exception) here."""
        return await asyncio.wrap_future(self._pool.submit(fn))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids, as the engine's own tokenization would give them."""
        tokenizer = self.checked_tokenizer()
        return await self.run(
            lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    async def render(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A conversation's prompt ids through the checkpoint's chat template (`tools`: the
        functions offered, which the template describes)."""
        from kvserve.chat_template import render

        chars = sum(len(m["content"]) for m in messages)
        self.check_length(chars, "messages")
        if tools and self.template_reads("tools"):  # the template writes them into the prompt
            self.check_length(chars + len(json.dumps(tools)), "tools")
        tokenizer = self.tokenizer
        try:
            ids = await self.run(
                lambda: render(tokenizer, messages, None, True, template_kwargs, tools)
            )
            return ids[1]
        except ValueError as exc:  # no template, or an empty rendering: say so
            raise APIError(str(exc), param="messages") from None

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable `name` (each name parsed once)."""
        from kvserve.chat_template import template_reads

        if name not in self._reads:
            self._reads[name] = template_reads(self.tokenizer, name)
        return self._reads[name]

    async def decode(self, ids: list[int]) -> str:
        tokenizer = self.checked_tokenizer()
        return await self.run(lambda: tokenizer.decode(ids))

    def check_decode_length(self, count: int, param: str) -> None:
        """At most max_model_len ids to decode (the longest sequence this server makes):
        a 400 before the ids are read, so a body of millions of ids costs no decode."""
        limit = self.max_model_len
        if limit is not None and count > limit:
            raise APIError(f"{param} has {count} ids; at most {limit} (max_model_len)", param=param)

    def check_ids(self, ids: list[int], param: str, vocab: int | None = None) -> None:
        """Token ids in [0, vocab) (default: the tokenizer's); a 400 naming the first not."""
        vocab = vocab or self.vocab_size
        if vocab is None:
            return
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            shown = bad if abs(bad) < 10**20 else "a huge id"
            raise APIError(f"token id {shown} is outside the vocabulary [0, {vocab})", param=param)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
