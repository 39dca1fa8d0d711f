"""`generate --prompt-token-ids`: prompts given as token ids, for a checkpoint without a
tokenizer (or to send exact ids). A value is JSON, a list of ints (one prompt) or a list of
such lists (several), or `@FILE`: one JSON list of ints per line (blank lines skipped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLAG = "--prompt-token-ids"
HELP = (
    "prompts as token ids: a JSON list of ints (one prompt), a list of such lists "
    "(several), or @FILE with one JSON list of ints per line; repeat to add more"
)


def read_prompt_token_ids(values: list[str]) -> list[list[int]]:
    """Every prompt the `--prompt-token-ids` values give, in order; ValueError naming the bad
    value (and line) otherwise."""
    prompts: list[list[int]] = []
    for value in values:
        if value.startswith("@"):
            prompts.extend(_read_file(Path(value[1:])))
        else:
            prompts.extend(_prompts(_json(value, f"{FLAG} {_short(value)}")))
    return prompts


def _read_file(path: Path) -> list[list[int]]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{FLAG} @{path}: cannot read: {reason}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{FLAG} @{path} line {number}"
        value = _json(line, where)
        if not _is_ids(value):
            raise ValueError(f"{where}: expected a non-empty JSON list of ints, got {_short(line)}")
        prompts.append(value)
    if not prompts:
        raise ValueError(f"{FLAG} @{path}: the file holds no prompt")
    return prompts


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None


def _prompts(value: Any) -> list[list[int]]:
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(_is_ids(item) for item in value):
        return value
    raise ValueError(
        f"{FLAG} {_short(json.dumps(value))}: expected a non-empty list of ints or a list of "
        "such lists"
    )


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
