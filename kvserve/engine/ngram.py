"""Prompt-lookup drafting: the tokens that followed the sequence's last n-gram before.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n
tokens are looked up in the earlier tokens (prompt and output); the latest
earlier occurrence proposes the tokens that followed it. Copy-heavy work
(summaries that quote, edits of a given text, answers citing a source) is
where this finds the right continuation.

Written here because the search is a few lines over the sequence's own
tokens (no library drafts from a token list): the tokens are packed once per
call as little-endian uint32 and the n-gram found with `bytes.rfind` (C
speed), a hit accepted only where it falls on a token boundary.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("I").itemsize


def propose_ngram(
    token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int, window: int = 8192
) -> list[int]:
    """Up to `num_tokens` draft tokens continuing `token_ids` (empty: no n-gram match).

    Only the last `window` tokens are searched, so a long context costs a
    bounded time per step.
    """
    total = len(token_ids)
    if num_tokens < 1 or total <= min_n:
        return []
    tail = token_ids[-window:] if total > window else token_ids
    packed = array("I", tail).tobytes()
    size = len(tail)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = packed[-n * _ITEM :]
        # The match must end before the last token, so at least one token follows it.
        end = len(packed) - _ITEM
        while True:
            found = packed.rfind(pattern, 0, end)
            if found < 0:
                break
            if found % _ITEM == 0:
                start = found // _ITEM + n
                return list(tail[start : start + num_tokens])
            end = found + len(pattern) - 1  # a match across token boundaries: look earlier
    return []
