"""JSONL traces: kvserve's own format and the Mooncake trace format.

kvserve: `{"id": str, "arrival": number, "prompt_token_ids": [int], "max_tokens": int}`;
`arrival` is a step number, or seconds with `arrival_unit="seconds"`.
Mooncake: `{"timestamp": ms, "input_length": int, "output_length": int,
"hash_ids": [int]}`; each hash id stands for a 512-token block whose tokens are
derived from the id, so equal ids give equal blocks (the last block may be
partial). Seconds become steps through `step_seconds`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvserve.simulate.workloads import VOCAB_SIZE, SimRequest, Workload

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be read; the message names file and line."""


def load_trace(
    path: str | Path,
    *,
    arrival_unit: str = "steps",
    step_seconds: float = 0.05,
    default_max_tokens: int = 16,
) -> Workload:
    if arrival_unit not in ("steps", "seconds"):
        raise ValueError(f"arrival_unit must be 'steps' or 'seconds', got {arrival_unit!r}")
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    blocks: dict[int, list[int]] = {}
    requests: list[SimRequest] = []
    total = 0
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            if "hash_ids" in obj:
                req = _mooncake(obj, where, len(requests), blocks, step_seconds)
            elif "prompt_token_ids" in obj:
                req = _own(
                    obj, where, len(requests), arrival_unit, step_seconds, default_max_tokens
                )
            else:
                raise TraceError(
                    f"{where}: neither a kvserve line (prompt_token_ids) "
                    "nor a Mooncake line (hash_ids)"
                )
            requests.append(req)
            total += len(req.prompt_token_ids) + req.max_tokens
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    requests.sort(key=lambda r: r.arrival_step)
    return Workload(f"trace:{path.name}", requests, max_total_tokens=total)


def _int(obj: dict, key: str, where: str, minimum: int = 0) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _arrival(value: object, where: str, key: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a number >= 0, got {value!r}")
    return float(value)


def _own(
    obj: dict, where: str, n: int, unit: str, step_seconds: float, default_max_tokens: int
) -> SimRequest:
    tokens = obj["prompt_token_ids"]
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens)
    ):
        raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list of token ids")
    arrival = _arrival(obj.get("arrival", 0), where, "arrival")
    step = int(arrival / step_seconds) if unit == "seconds" else int(arrival)
    max_tokens = _int(obj, "max_tokens", where, 1) if "max_tokens" in obj else default_max_tokens
    return SimRequest(str(obj.get("id", f"req-{n}")), step, tokens, max_tokens)


def _mooncake(
    obj: dict, where: str, n: int, blocks: dict[int, list[int]], step_seconds: float
) -> SimRequest:
    length = _int(obj, "input_length", where, 1)
    output = _int(obj, "output_length", where, 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    if len(ids) * MOONCAKE_BLOCK_TOKENS < length:
        raise TraceError(
            f"{where}: {len(ids)} hash ids cover {len(ids) * MOONCAKE_BLOCK_TOKENS} tokens, "
            f"fewer than input_length {length}"
        )
    tokens: list[int] = []
    for hash_id in ids:
        block = blocks.get(hash_id)
        if block is None:
            rng = random.Random(f"mooncake:{hash_id}")
            block = [rng.randrange(VOCAB_SIZE) for _ in range(MOONCAKE_BLOCK_TOKENS)]
            blocks[hash_id] = block
        tokens.extend(block)
        if len(tokens) >= length:
            break
    del tokens[length:]
    seconds = _arrival(obj.get("timestamp", 0), where, "timestamp") / 1000.0
    return SimRequest(f"mooncake-{n}", int(seconds / step_seconds), tokens, output)
